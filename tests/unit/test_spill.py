"""A sample too long for the host buffer is spilled (`capture.spill`): its rows go to a file as its steps come, and
its shard's writer streams each state back from it. The shard's bytes are those of the sample held in memory, the
spill file goes once written or abandoned, and the writer refuses a streamed state of the wrong size."""

import queue

import pytest
import torch

from eagle_states.capture import protocol as p
from eagle_states.capture import spill
from eagle_states.capture.assembler import Assembler
from eagle_states.capture.forward import PinnedPool
from eagle_states.capture.handoff import CapturedSample, ShardPlan, Step, StepRequest, fits_host_buffer
from eagle_states.capture.shard_writer import ShardWriter
from eagle_states.capture.spill import SpillFile
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.shard_file import ShardFileWriter, sample_tensor_specs

STATES, WIDTH, STEP = 3, 48, 64  # captured layers, hidden size, rows per step


def steps_of(states: torch.Tensor) -> list[tuple[int, list[torch.Tensor]]]:
    """A sample's [layer, token, hidden] states as chunked prefill hands them over: (first row, a piece per layer)."""
    return [(start, list(states[:, start:start + STEP])) for start in range(0, states.shape[1], STEP)]


def write(tmp_path, name: str, samples: dict[str, torch.Tensor], spilled: set[str]) -> bytes:
    """A shard of `samples` written by the capture's shard writer, those in `spilled` through spill files."""
    path = str(tmp_path / name)
    pinned = PinnedPool(STATES, STEP, 1 << 20, STATES * WIDTH * 2)

    def take(sample_id):  # complete samples, as the assembler hands them over
        states, n = samples[sample_id], samples[sample_id].shape[1]
        if sample_id not in spilled:
            return CapturedSample(torch.arange(n), [pieces for _, pieces in steps_of(states)], [])
        spilling = SpillFile(path, n)
        for first, pieces in steps_of(states):
            spilling.add(first, pieces)
        assert spilling.bytes == states.numel() * states.element_size()
        return CapturedSample(torch.arange(n), [], [], spilling)

    writer = ShardWriter(STATES, write_threads=1, pinned=pinned, kept_limit=1 << 30)
    plan = ShardPlan(list(samples), {s: t.shape[1] for s, t in samples.items()},
                     {s: [1] * t.shape[1] for s, t in samples.items()}, Codec())
    writer.submit(path, plan, take).result(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir() if name in p.name) == [name], "the spill files are gone"
    return (tmp_path / name).read_bytes()


def test_a_spilled_sample_gives_the_bytes_of_one_held_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "READ_BYTES", 1000)  # a state read back in many pieces, the last one short
    torch.manual_seed(0)
    samples = {"a": torch.randn(STATES, 300, WIDTH).to(torch.bfloat16),
               "b": torch.randn(STATES, 70, WIDTH).to(torch.bfloat16),
               "c": torch.randn(STATES, 5, WIDTH).to(torch.bfloat16)}
    held = write(tmp_path, "held.safetensors", samples, spilled=set())
    assert write(tmp_path, "spilled.safetensors", samples, spilled={"a", "c"}) == held
    assert write(tmp_path, "all.safetensors", samples, spilled=set(samples)) == held


def test_an_abandoned_spill_file_goes(tmp_path):
    spilling = SpillFile(str(tmp_path / "shard-00000.safetensors"), 100)
    spilling.add(0, list(torch.zeros(STATES, STEP, WIDTH)))
    assert [p.name.startswith(".shard-00000.safetensors.spill-") for p in tmp_path.iterdir()] == [True]
    CapturedSample(torch.arange(100), [], [], spilling).forget(PinnedPool(STATES, STEP, 1 << 20, 1))
    assert list(tmp_path.iterdir()) == []


def test_a_capture_discarded_midway_leaves_no_spill_file(tmp_path):
    """Through the assembler: a sample of 3 steps does not fit 4 blocks (its 3 steps and the next one's), so its
    rows go to a spill file from its first step; a failure's discard removes it with the half-captured sample."""
    pinned = PinnedPool(STATES, STEP, 1, STATES * WIDTH * 4)  # the least: 4 blocks, samples of up to 2 steps
    work = queue.Queue()
    assembler = Assembler(work, ShardWriter(STATES, write_threads=1, pinned=pinned, kept_limit=1 << 30), pinned)
    n, states = 3 * STEP, torch.randn(STATES, 3 * STEP, WIDTH)
    work.put(p.BeginShard(path=str(tmp_path / "shard-00000.safetensors"), sample_ids=["a"], num_tokens=[n],
                          loss_masks=[[1] * n]))
    for start in (0, STEP):  # two of its three steps
        rows = torch.arange(start, start + STEP)
        work.put(Step([StepRequest("a", 0, STEP, n, False, start)], rows, rows, list(states[:, start:start + STEP]),
                      block=None, copied=None))
    work.join()
    assert assembler.take_failure() is None
    spilled = [p.name for p in tmp_path.iterdir()]
    assert len(spilled) == 1 and spilled[0].startswith(".shard-00000.safetensors.spill-")
    assert (tmp_path / spilled[0]).stat().st_size == (STATES - 1) * n * WIDTH * 4 + 2 * STEP * WIDTH * 4
    assert assembler.discard() == ["a"]
    assert list(tmp_path.iterdir()) == []


def test_a_streamed_state_of_the_wrong_size_is_refused(tmp_path):
    specs = sample_tensor_specs("s", 10, 1, WIDTH, torch.float32)
    with pytest.raises(ValueError, match="got 1,728 bytes, the header says 1,920"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs) as out:
            out.write_streamed("s/hidden_states/0", [torch.zeros(9, WIDTH)])
    with pytest.raises(ValueError, match="got 2,112 bytes or more of torch.float32, the header says 1,920"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs) as out:
            out.write_streamed("s/hidden_states/0", [torch.zeros(9, WIDTH), torch.zeros(2, WIDTH)])
    assert list(tmp_path.iterdir()) == []


def test_the_spill_rule_is_the_pinned_pools():
    """A sample holds every step its rows span and the next one's; the pool has at least 4 blocks."""
    row = STATES * WIDTH * 2
    assert fits_host_buffer(2 * STEP, 1, row, STEP) and not fits_host_buffer(2 * STEP + 1, 1, row, STEP)
    block = row * STEP + row * STEP // 64 + (1 << 20)
    assert fits_host_buffer(8 * STEP, 10 * block, row, STEP)
    assert not fits_host_buffer(8 * STEP + 1, 10 * block, row, STEP)
