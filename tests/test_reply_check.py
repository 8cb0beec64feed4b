"""`collective_rpc` returns one reply per worker; the driver refuses any reply list it does not expect."""

import pytest
import torch

from eagle_states.vllm_capture import CaptureError, check_poll_agreement, check_replies


def reply(rank, world=2, writer=None, samples=None):
    payload = {"shard": "s", "samples": samples if samples is not None else {"a": [3, 17]}}
    return {"rank": rank, "world_size": world, "writer": rank == 0 if writer is None else writer, "payload": payload}


def test_well_formed_replies_give_the_writer_payload():
    assert check_replies([reply(1), reply(0)], "eagle_write_shard", 2) == reply(0)["payload"]


@pytest.mark.parametrize("replies, message", [
    (reply(0, world=1), "expected a list"),  # someone indexed [0] already
    ([reply(0)], "1 replies for 2 ranks"),  # one reply missing
    ([reply(0), reply(0)], "ranks [0, 0]"),
    ([reply(0), reply(1, writer=True)], "2 ranks claim to write"),
    ([reply(0, writer=False), reply(1)], "0 ranks claim to write"),
    ([reply(0), {**reply(1), "extra": 1}], "expected keys"),
    ([reply(0), reply(1, world=4)], "world size 4"),
    # the seed's bug: the first layer's [T, H] tensor handed on where the list of L tensors belonged
    ([torch.zeros(771, 512), reply(1)], "reply 0 has Tensor"),
])
def test_wrong_structures_are_refused(replies, message):
    with pytest.raises(CaptureError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_replies(replies, "eagle_write_shard", 2)


def test_ranks_must_agree_on_what_they_captured():
    writer = {"samples": {"a": [3, 17]}, "sha256": "x", "bytes": 10}
    assert check_poll_agreement({0: writer, 1: {"samples": {"a": [3, 17]}}}, 2, "s") == writer
    with pytest.raises(CaptureError, match="different samples"):
        check_poll_agreement({0: writer, 1: {"samples": {"a": [4, 17]}}}, 2, "s")
    with pytest.raises(CaptureError, match="reports from ranks"):
        check_poll_agreement({0: writer}, 2, "s")
    with pytest.raises(CaptureError, match="2 ranks report a written file"):
        check_poll_agreement({0: writer, 1: writer}, 2, "s")
