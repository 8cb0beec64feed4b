"""`collective_rpc` returns one reply per worker; the driver refuses any reply list it does not expect, and the
calls and replies are typed messages checked on both sides."""

import pydantic
import pytest
import torch

from eagle_states.capture import protocol as p
from eagle_states.capture.protocol import CaptureError, check_replies, check_shard_agreement, writer_payload

CALL = p.Poll(wait=False)


def reply(rank, world=2, writer=None, payload=None):
    return p.Envelope(rank=rank, world_size=world, writer=rank == 0 if writer is None else writer,
                      payload=payload or p.PollReply(shards={}, launched=[f"from-{rank}"]))


def test_well_formed_replies_give_the_writer_payload():
    assert writer_payload(check_replies([reply(1), reply(0)], CALL, 2)) == reply(0).payload


@pytest.mark.parametrize("replies, message", [
    (reply(0, world=1), "expected a list"),  # someone indexed [0] already
    ([reply(0)], "1 replies for 2 ranks"),  # one reply missing
    ([reply(0), reply(0)], "ranks [0, 0]"),
    ([reply(0), reply(1, writer=True)], "2 ranks claim to write"),
    ([reply(0, writer=False), reply(1)], "0 ranks claim to write"),
    ([reply(0), {"rank": 1, "world_size": 2, "writer": False, "payload": {}}], "reply 1 is a dict"),
    ([reply(0), reply(1, world=4)], "world size 4"),
    ([reply(0), reply(1, payload=p.Queued(path="x"))], "carries a Queued, expected PollReply"),
    # the seed's bug: the first layer's [T, H] tensor handed on where the list of L tensors belonged
    ([torch.zeros(771, 512), reply(1)], "reply 0 is a Tensor"),
])
def test_wrong_structures_are_refused(replies, message):
    with pytest.raises(CaptureError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_replies(replies, CALL, 2)


def test_messages_are_checked_when_they_are_made():
    with pytest.raises(pydantic.ValidationError):
        p.BeginShard(path="s", sample_ids=["a"], num_tokens=["three"], loss_masks=[[1]])
    with pytest.raises(pydantic.ValidationError):
        p.Poll(wait=False, extra=1)
    assert set(p.REPLY) == {p.Setup, p.BeginShard, p.EndShard, p.FinishGeneration, p.Poll, p.Stats, p.Discard}


def test_ranks_must_agree_on_what_they_captured():
    writer = p.ShardReport(samples={"a": (3, 17)}, digest="x", bytes=10)
    assert check_shard_agreement({0: writer, 1: p.ShardReport(samples={"a": (3, 17)})}, 2, "s") == writer
    with pytest.raises(CaptureError, match="different samples"):
        check_shard_agreement({0: writer, 1: p.ShardReport(samples={"a": (4, 17)})}, 2, "s")
    with pytest.raises(CaptureError, match="reports from ranks"):
        check_shard_agreement({0: writer}, 2, "s")
    with pytest.raises(CaptureError, match="2 ranks report a written file"):
        check_shard_agreement({0: writer, 1: writer}, 2, "s")
