"""A sample too long for the host buffer is spilled (`capture.spill`): its rows go to a file as its steps come, and
its shard's writer streams each state back from it. The shard's bytes are those of the sample held in memory,
uncompressed or as a step codec encoded it; the spill file goes once written or abandoned, and the writer refuses a
streamed state of the wrong size, or one that streams other bytes for the digest than it wrote."""

import errno
import os
import queue
import subprocess

import pytest
import torch

from eagle_states.capture import protocol as p
from eagle_states.capture import spill
from eagle_states.capture.assembler import Assembler
from eagle_states.capture.forward import PinnedPool
from eagle_states.capture.handoff import CapturedSample, ShardPlan, Step, StepRequest, fits_host_buffer
from eagle_states.capture.shard_writer import ShardWriter
from eagle_states.capture.spill import SpillFile, spill_file
from eagle_states.dataset import step_codecs
from eagle_states.dataset import codec as codec_module
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.shard_file import ShardFileWriter, ShardReader, StreamedTensor, sample_tensor_specs
from eagle_states.dataset.step_codecs import NvcompPiece, fp8_ans_encode_step, fp8_encode_step
from helpers import identity_ans

STATES, WIDTH, STEP = 3, 48, 64  # captured layers, hidden size, rows per step


def steps_of(states: torch.Tensor, codec: str = "none") -> list[tuple[int, list]]:
    """A sample's [layer, token, hidden] states as chunked prefill hands them over: (first row, a piece per layer),
    plain (a CPU codec's too) or as a step codec encoded them (nvcomp-ans and fp8-e4m3-ans with stand-ins for
    nvCOMP's ANS, which needs a CUDA device: the bytes framed are what they are)."""
    out = []
    for start in range(0, states.shape[1], STEP):
        step = states[:, start:start + STEP]
        rows = step.shape[1]
        if not Codec(codec).on_device:
            pieces = [layer.clone() for layer in step]  # a pinned block of its own
        elif codec == "nvcomp-ans":  # buffers of odd sizes, as ANS's are
            pieces = [NvcompPiece(layer.reshape(-1).view(torch.uint8)[:rows * WIDTH + slot].clone(), rows, WIDTH,
                                  step.dtype) for slot, layer in enumerate(step)]
        else:
            encoded = (fp8_encode_step(step) if codec == "fp8-e4m3" else
                       fp8_ans_encode_step(step, [(0, rows)], identity_ans))
            pieces = [layer[0:rows] for layer in encoded.host_rows(encoded.data, codec)]
        out.append((start, pieces))
    return out


def write(tmp_path, name: str, samples: dict[str, torch.Tensor], spilled: set[str], codec: str = "none") -> bytes:
    """A shard of `samples` written by the capture's shard writer, those in `spilled` through spill files."""
    path = str(tmp_path / name)
    pinned = PinnedPool(STATES, STEP, 1 << 20, STATES * WIDTH * 2)

    def take(sample_id):  # complete samples, as the assembler hands them over
        states, n = samples[sample_id], samples[sample_id].shape[1]
        steps = steps_of(states, codec)
        if sample_id not in spilled:
            return CapturedSample(torch.arange(n), [pieces for _, pieces in steps], [])
        spilling = spill_file(path, n, Codec(codec))
        for first, pieces in steps:
            spilling.add(first, pieces)
            for piece in pieces:  # the step's pinned block goes back to the pool and is filled again
                getattr(piece, "body", piece).fill_(0)
                getattr(piece, "aux", torch.empty(0)).fill_(0)
        stored = [getattr(piece, "body", piece) for _, pieces in steps for piece in pieces]
        assert spilling.bytes == sum(t.numel() * t.element_size() for t in stored)
        return CapturedSample(torch.arange(n), [], [], spilling)

    writer = ShardWriter(STATES, write_threads=1, pinned=pinned, kept_limit=1 << 30)
    plan = ShardPlan(list(samples), {s: t.shape[1] for s, t in samples.items()},
                     {s: [1] * t.shape[1] for s, t in samples.items()}, Codec(codec))
    writer.submit(path, plan, take).result(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir() if name in p.name) == [name], "the spill files are gone"
    assert (writer.spill_read_s > 0) == bool(spilled) and writer.commit_s > 0  # the writer's time, taken apart
    assert writer.spill_read_s + writer.commit_s + writer.hash_s + writer.write_wait_s <= writer.shard_s
    assert writer.encode_s >= 0  # a CPU codec's, less the spill reads inside it
    return (tmp_path / name).read_bytes()


@pytest.mark.parametrize("codec", ["none", "blosc2-zstd", "fp8-e4m3", "nvcomp-ans", "fp8-e4m3-ans"])
def test_a_spilled_sample_gives_the_bytes_of_one_held_in_memory(tmp_path, monkeypatch, codec):
    monkeypatch.setattr(spill, "READ_BYTES", 1000)  # a state read back in many pieces, the last one short
    monkeypatch.setattr(codec_module, "CHUNK_BYTES", 1536)  # Blosc2's chunks across the pieces of both
    monkeypatch.setattr(step_codecs, "nvcomp_version", lambda: "6.0.0")  # the codec's record, without nvCOMP here
    torch.manual_seed(0)
    samples = {"a": torch.randn(STATES, 300, WIDTH).to(torch.bfloat16),
               "b": torch.randn(STATES, 70, WIDTH).to(torch.bfloat16),
               "c": torch.randn(STATES, 5, WIDTH).to(torch.bfloat16)}
    held = write(tmp_path, "held.safetensors", samples, spilled=set(), codec=codec)
    assert write(tmp_path, "spilled.safetensors", samples, spilled={"a", "c"}, codec=codec) == held
    assert write(tmp_path, "all.safetensors", samples, spilled=set(samples), codec=codec) == held
    if codec == "fp8-e4m3":  # and they read back as fp8's states
        with ShardReader(tmp_path / "all.safetensors") as reader:
            states = reader.get_tensor("a/hidden_states/2")
        assert states.dtype == torch.bfloat16 and torch.allclose(states, samples["a"][2], rtol=0.07, atol=0.02)


def where(spilling: SpillFile) -> str:
    """The directory of a spill file's open file, and its name there (a file with no name: none)."""
    directory, name = os.path.split(os.readlink(f"/proc/self/fd/{spilling.fd}"))
    return directory, None if name.endswith(" (deleted)") else name


def test_a_spill_file_has_no_name_and_goes_with_its_sample(tmp_path):
    """A file with no name (O_TMPFILE) beside its shard or in extract.spill_dir: nothing is left of it once its
    sample is forgotten, or its process ends however it ends."""
    for directory in (None, tmp_path / "spill"):
        spilling = SpillFile(str(tmp_path / "shard-00000.safetensors"), 100, directory and str(directory))
        spilling.add(0, list(torch.zeros(STATES, STEP, WIDTH)))
        assert where(spilling) == (str(directory or tmp_path), None)
        assert os.fstat(spilling.fd).st_size == (2 * 100 + STEP) * WIDTH * 4  # layer regions of 100 rows
        fd = spilling.fd
        CapturedSample(torch.arange(100), [], [], spilling).forget(PinnedPool(STATES, STEP, 1 << 20, 1))
        with pytest.raises(OSError):
            os.fstat(fd)
    assert [p.name for p in tmp_path.iterdir()] == ["spill"] and not list((tmp_path / "spill").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root: there it runs)")
def test_a_full_spill_directory_is_named(tmp_path):
    """A disk that fills while a sample is spilled: the error names the directory (its file has no name)."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        spilling = SpillFile(str(tmp_path / "shard-00000.safetensors"), 1000, str(full))
        with pytest.raises(OSError) as refused:
            spilling.add(0, list(torch.zeros(STATES, 1000, WIDTH)))
        assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(full)
        assert "a sample spilled there" in str(refused.value)
        spilling.close()
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_where_a_file_with_no_name_cannot_be_made_a_spill_file_is_named_beside_its_shard(tmp_path, monkeypatch):
    """NFS cannot make one: beside its shard a temp file named after it (removed at the next start of a crashed
    run, like the shard's own); in extract.spill_dir, refused before the model loads."""
    monkeypatch.setattr(spill, "unnamed_file", lambda directory: None)
    spilling = SpillFile(str(tmp_path / "shard-00000.safetensors"), 100)
    spilling.add(0, list(torch.zeros(STATES, STEP, WIDTH)))
    assert where(spilling)[1].startswith(".shard-00000.safetensors.spill-")
    assert [p.name for p in tmp_path.iterdir()] == [where(spilling)[1]]
    assert next(spilling.pieces(0)).shape == (100, WIDTH)  # read back through its own descriptor
    CapturedSample(torch.arange(100), [], [], spilling).forget(PinnedPool(STATES, STEP, 1 << 20, 1))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="spill_dir .*: its filesystem cannot make a file with no name"):
        spill.check_spill_dir(str(tmp_path / "spill"))


def test_a_capture_discarded_midway_leaves_no_spill_file(tmp_path):
    """Through the assembler: a sample of 3 steps does not fit 4 blocks (its 3 steps and the next one's), so its
    rows go to a spill file from its first step, in the shard's spill directory; a failure's discard removes it
    with the half-captured sample."""
    pinned = PinnedPool(STATES, STEP, 1, STATES * WIDTH * 4)  # the least: 4 blocks, samples of up to 2 steps
    work = queue.Queue()
    assembler = Assembler(work, ShardWriter(STATES, write_threads=1, pinned=pinned, kept_limit=1 << 30), pinned)
    n, states = 3 * STEP, torch.randn(STATES, 3 * STEP, WIDTH)
    work.put(p.BeginShard(path=str(tmp_path / "shard-00000.safetensors"), sample_ids=["a"], num_tokens=[n],
                          loss_masks=[[1] * n], spill_dir=str(tmp_path / "spill")))
    for start in (0, STEP):  # two of its three steps
        rows = torch.arange(start, start + STEP)
        work.put(Step([StepRequest("a", 0, STEP, n, False, start)], rows, rows, list(states[:, start:start + STEP]),
                      block=None, copied=None))
    work.join()
    assert assembler.take_failure() is None
    spilled = assembler.partial["a"].spill
    assert where(spilled) == (str(tmp_path / "spill"), None)
    assert os.fstat(spilled.fd).st_size == (STATES - 1) * n * WIDTH * 4 + 2 * STEP * WIDTH * 4
    assert assembler.discard() == ["a"]
    assert spilled.fd == -1 and [p.name for p in tmp_path.iterdir()] == ["spill"]


def test_a_streamed_state_of_the_wrong_size_is_refused(tmp_path):
    specs = sample_tensor_specs("s", 10, 1, WIDTH, torch.float32)
    with pytest.raises(ValueError, match="got 1,728 bytes, the header says 1,920"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs) as out:
            out.write_streamed("s/hidden_states/0", StreamedTensor(lambda: [torch.zeros(9, WIDTH)], 10))
    with pytest.raises(ValueError, match="got 2,112 bytes or more of torch.float32, the header says 1,920"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs) as out:
            out.write_streamed("s/hidden_states/0",
                               StreamedTensor(lambda: [torch.zeros(9, WIDTH), torch.zeros(2, WIDTH)], 10))
    with pytest.raises(ValueError, match="got 9 encoded rows, the header says 10"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs, Codec("fp8-e4m3")) as out:
            out.write_streamed("s/hidden_states/0", StreamedTensor(lambda: [torch.zeros(9 * (4 + WIDTH))], 9))
    with pytest.raises(ValueError, match="got 1,728 bytes, the header says 1,920"):  # compressed as they come
        with ShardFileWriter(tmp_path / "x.safetensors", specs, Codec("blosc2-zstd")) as out:
            out.write_streamed("s/hidden_states/0", StreamedTensor(lambda: [torch.zeros(9, WIDTH)], 10))
    assert list(tmp_path.iterdir()) == []


def test_a_compressed_state_streamed_again_for_the_digest_must_give_the_bytes_written(tmp_path):
    """A step codec's streamed state is not kept: the shard's digest streams it again at the end (a spill file read
    once more), and bytes other than those written (their CRC-32) fail the shard rather than give it a digest of
    bytes it does not hold."""
    specs = sample_tensor_specs("s", 10, 1, WIDTH, torch.float32)
    calls = []

    def pieces():  # fp8's stored bytes: scales, then codes; the second time one byte differs
        calls.append(1)
        stored = torch.zeros(10 * (4 + WIDTH), dtype=torch.uint8)
        stored[-1] = len(calls)
        return [stored[:40], stored[40:]]

    with pytest.raises(OSError, match="s/hidden_states/0 streamed again for the digest gave other bytes"):
        with ShardFileWriter(tmp_path / "x.safetensors", specs, Codec("fp8-e4m3")) as out:
            out.write_streamed("s/hidden_states/0", StreamedTensor(pieces, 10, {"sq_err": 0.0, "sq_sum": 1.0}))
            out.write_many({"s/input_ids": [torch.arange(10, dtype=torch.int32)],
                            "s/loss_mask": [torch.ones(10, dtype=torch.uint8)]})
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_the_spill_rule_is_the_pinned_pools():
    """A sample holds every step its rows span and the next one's; the pool has at least 4 blocks."""
    row = STATES * WIDTH * 2
    assert fits_host_buffer(2 * STEP, 1, row, STEP) and not fits_host_buffer(2 * STEP + 1, 1, row, STEP)
    block = row * STEP + row * STEP // 64 + (1 << 20)
    assert fits_host_buffer(8 * STEP, 10 * block, row, STEP)
    assert not fits_host_buffer(8 * STEP + 1, 10 * block, row, STEP)
