"""The step codecs without an engine: fp8 e4m3 with per-token scales (its error bound, its record, the shard it
makes read back in the capture's dtype), and the nvCOMP frame's checks (the decoding itself needs a CUDA device:
bench/gpu_check.py and the H200 runs in bench/RESULTS.md)."""

import errno
import struct
import threading
import time

import numpy as np
import pytest
import torch

from eagle_states.dataset import step_codecs
from eagle_states.dataset.codec import FP8_MAX_RELATIVE_ERROR, Codec, CorruptTensorError
from eagle_states.dataset.kept_bytes import KeptBytes
from eagle_states.dataset.shard_file import ShardFileWriter, ShardReader, read_header, sample_tensor_specs
from eagle_states.dataset.step_codecs import (CodecUnavailable, Fp8AnsPiece, NvcompPiece,
                                              decode_fp8_ans, decode_nvcomp, fp8_ans_encode_step, fp8_encode_step,
                                              frame, nvcomp_buffers)
from helpers import identity_ans, refuse_a_write

FP8 = Codec("fp8-e4m3")


def captured_like(layers=3, rows=40, width=64, dtype=torch.float32):
    """States shaped like a residual stream: a few large outlier channels over small values, growing by layer."""
    torch.manual_seed(0)
    x = torch.randn(layers, rows, width)
    x[:, :, :2] *= 30
    return (x * torch.arange(1, layers + 1).view(-1, 1, 1)).to(dtype)


def write_fp8_shard(path, stacked, spans, split=True, encode_threads=1, room=None):
    """One step holding samples' rows (spans), written as the capture's writer does: a sample at a time, each
    state in two pieces, as chunked prefill gives it, or (`split=False`) in one; its kept tensors counted in `room`
    (`kept_bytes`)."""
    step = fp8_encode_step(stacked)
    rows = step.host_rows(step.data, FP8.name)
    specs = {}
    for i, (start, stop) in enumerate(spans):
        specs.update(sample_tensor_specs(f"s{i}", stop - start, stacked.shape[0], stacked.shape[2], stacked.dtype))
    with ShardFileWriter(path, specs, FP8, encode_threads, kept=room) as out:
        for i, (start, stop) in enumerate(spans):
            middle = (start + stop) // 2
            sample = {}
            for name in [n for n in out.order if n.startswith(f"s{i}/")]:
                field = name.split("/", 1)[1]
                if field == "input_ids":
                    sample[name] = [torch.arange(start, stop, dtype=torch.int32)]
                elif field == "loss_mask":
                    sample[name] = [torch.ones(stop - start, dtype=torch.uint8)]
                else:
                    slot = int(field.rsplit("/", 1)[1])
                    sample[name] = ([rows[slot][start:middle], rows[slot][middle:stop]] if split
                                    else [rows[slot][start:stop]])
            out.write_many(sample)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reads_back_in_the_capture_dtype_within_its_bound_and_records_its_error(tmp_path, dtype):
    stacked = captured_like(dtype=dtype)
    spans = [(0, 25), (25, 40)]
    write_fp8_shard(tmp_path / "shard.safetensors", stacked, spans)
    with ShardReader(tmp_path / "shard.safetensors") as shard:
        assert shard.codec["name"] == "fp8-e4m3" and shard.codec["lossy"] is True
        for i, (start, stop) in enumerate(spans):
            for slot in range(stacked.shape[0]):
                key = f"s{i}/hidden_states/{slot}"
                info = shard.info(key)
                got, want = shard.get_tensor(key), stacked[slot, start:stop].float()
                assert got.dtype == dtype and list(got.shape) == info["shape"] == [stop - start, stacked.shape[2]]
                # the recorded error is the error of what is read back (bf16 output adds its own rounding)
                measured = ((got.float() - want) ** 2).sum().item()
                assert info["sq_err"] == pytest.approx(measured, rel=0.15 if dtype == torch.bfloat16 else 1e-4)
                assert info["sq_sum"] == pytest.approx((want ** 2).sum().item(), rel=1e-5)
                relative = (info["sq_err"] / info["sq_sum"]) ** 0.5
                assert 0.005 < relative < FP8_MAX_RELATIVE_ERROR  # lossy, and within e4m3's 3 mantissa bits
                # per-token scale: every row's largest value comes back to within e4m3's rounding
                assert torch.allclose(got.float().abs().amax(-1), want.abs().amax(-1), rtol=0.07)
            assert torch.equal(shard.get_tensor(f"s{i}/input_ids"), torch.arange(start, stop, dtype=torch.int32))


def test_an_fp8_sample_of_one_row_in_one_piece_is_framed(tmp_path):
    """A one-row column keeps its stride through `contiguous`, which a byte view refuses (found on the H200 by
    bench/gpu_codec_check.py: a step with a one-row span)."""
    stacked = captured_like(rows=8)
    write_fp8_shard(tmp_path / "shard.safetensors", stacked, [(0, 1), (1, 8)], split=False)
    with ShardReader(tmp_path / "shard.safetensors") as shard:
        got = shard.get_tensor("s0/hidden_states/2")
    assert got.shape == (1, 64) and torch.allclose(got, stacked[2, :1], rtol=0.07, atol=0)


def test_fp8_is_a_byte_per_value_plus_a_scale_per_token(tmp_path):
    stacked = captured_like(rows=64, width=256)
    out = write_fp8_shard(tmp_path / "shard.safetensors", stacked, [(0, 64)])
    plain_states = stacked.numel() * 4
    assert out.size < plain_states / 3.5  # fp32 -> 1 byte per value (+ 4 bytes per token and the header)


def test_zero_rows_and_a_damaged_fp8_tensor(tmp_path):
    stacked = captured_like()
    stacked[:, 3] = 0  # a zero state (scale 1, not a division by zero)
    write_fp8_shard(tmp_path / "shard.safetensors", stacked, [(0, 40)])
    with ShardReader(tmp_path / "shard.safetensors") as shard:
        got = shard.get_tensor("s0/hidden_states/1")
        assert torch.isfinite(got).all() and not got[3].any()
    stacked_before = stacked.clone()
    fp8_encode_step(stacked)
    assert torch.equal(stacked, stacked_before)  # encoding leaves the step's states as they were
    data = bytearray((tmp_path / "shard.safetensors").read_bytes())
    header = read_header(tmp_path / "shard.safetensors")
    data[8 + int.from_bytes(data[:8], "little") + header["s0/hidden_states/2"]["data_offsets"][0] + 50] ^= 0x40
    (tmp_path / "shard.safetensors").write_bytes(bytes(data))
    with ShardReader(tmp_path / "shard.safetensors") as shard, pytest.raises(CorruptTensorError, match="CRC-32"):
        shard.get_tensor("s0/hidden_states/2")


def test_the_compiled_fp8_step_makes_the_eager_codes_and_scales():
    """On CUDA the capture runs `fp8_quantize` compiled over all layers at once; here Inductor's CPU backend stands
    in for Triton (the device's run: bench/gpu_codec_check.py): one graph (fullgraph), any row count (dynamic),
    and the eager path's codes and scales."""
    for rows in (40, 7, 1):  # the count changes from step to step; a single row is a shape of its own to Inductor
        stacked = captured_like(rows=rows, dtype=torch.bfloat16)
        stacked[:, 0] = 0
        fused, eager = fp8_encode_step(stacked, fused=True), fp8_encode_step(stacked, fused=False)
        for f, e in zip(fused.host_rows(fused.data, FP8.name), eager.host_rows(eager.data, FP8.name)):
            assert torch.equal(f.codes, e.codes) and torch.equal(f.aux[:, 0], e.aux[:, 0])
            assert torch.allclose(f.aux[:, 1:], e.aux[:, 1:], rtol=1e-4, atol=1e-6)


def test_the_nvcomp_frame_is_checked_before_any_decoding_and_needs_a_cuda_device():
    stored, extra = frame("nvcomp-ans", [NvcompPiece(torch.arange(10, dtype=torch.uint8), 3, 8, torch.bfloat16),
                                         NvcompPiece(torch.arange(7, dtype=torch.uint8), 2, 8, torch.bfloat16)])
    assert extra == {}
    buffers, decoded = nvcomp_buffers(np.frombuffer(stored, dtype=np.uint8))
    assert [b.tolist() for b in buffers] == [list(range(10)), list(range(7))] and decoded == [3 * 8 * 2, 2 * 8 * 2]
    with pytest.raises(ValueError, match="buffers of"):
        nvcomp_buffers(np.frombuffer(stored[:-1], dtype=np.uint8))
    with pytest.raises(ValueError, match="frame of"):
        nvcomp_buffers(np.frombuffer(struct.pack("<I", 1000), dtype=np.uint8))
    if not torch.cuda.is_available():
        with pytest.raises(CodecUnavailable, match="CUDA device only"):
            decode_nvcomp(np.frombuffer(stored, dtype=np.uint8), [5, 8], torch.bfloat16)


def test_fp8_ans_frames_fp8s_scales_and_errors_before_the_codes_nvcomp_frame():
    """fp8-e4m3-ans from a step to the stored bytes of a tensor, on the CPU with an identity for ANS: the scales,
    codes and error sums are fp8-e4m3's, the codes' buffers follow in nvcomp-ans's frame with a byte per decoded
    code; buffers of odd sizes (width 7) still leave the per-row float32 numbers readable."""
    stacked = captured_like(layers=2, rows=9, width=7)
    spans = [(0, 3), (3, 9)]
    step = fp8_ans_encode_step(stacked, spans, identity_ans)
    assert sum(step.sizes) % 4 != 0  # the float numbers after them needed padding
    fp8 = fp8_encode_step(stacked)
    for slot, (ours, plain) in enumerate(zip(step.host_rows(step.data, "fp8-e4m3-ans"),
                                             fp8.host_rows(fp8.data, "fp8-e4m3"))):
        pieces = [ours[start:stop] for start, stop in spans]
        assert all(isinstance(p, Fp8AnsPiece) for p in pieces)
        stored, errors = frame("fp8-e4m3-ans", pieces)
        plain_stored, plain_errors = frame("fp8-e4m3", [plain[start:stop] for start, stop in spans])
        assert errors == plain_errors and stored[:9 * 4].tobytes() == plain_stored[:9 * 4].tobytes()  # scales
        buffers, decoded = nvcomp_buffers(stored[9 * 4:])
        assert np.concatenate(buffers).tobytes() == plain_stored[9 * 4:].tobytes()  # the codes, span by span
        assert decoded == [3 * 7, 6 * 7]
    assert Codec("fp8-e4m3-ans").lossy and Codec("fp8-e4m3-ans").entry_extras == ("sq_err", "sq_sum")
    if not torch.cuda.is_available():
        with pytest.raises(CodecUnavailable, match="CUDA device only"):
            decode_fp8_ans(stored, [9, 7], torch.float32)
    with pytest.raises(ValueError, match="buffers of"):
        decode_fp8_ans(stored[:-1], [9, 7], torch.float32)


@pytest.mark.parametrize("encode_threads", [1, 3])
def test_an_fp8_shard_whose_write_fails_midway_raises_it_and_leaves_nothing(tmp_path, monkeypatch, encode_threads):
    """The step codec's tensors are framed while the ones before are still being written (as a CPU codec's): the
    disk refusing a piece midway stops the shard with that error and leaves no file."""
    refuse_a_write(monkeypatch, 4)
    with pytest.raises(OSError) as refused:
        write_fp8_shard(tmp_path / "shard.safetensors", captured_like(rows=60), [(0, 20), (20, 45), (45, 60)],
                        encode_threads=encode_threads)
    assert refused.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_samples_states_framed_at_once_give_the_bytes_framed_one_by_one(tmp_path):
    stacked, spans = captured_like(rows=60), [(0, 20), (20, 45), (45, 60)]
    one = write_fp8_shard(tmp_path / "one.safetensors", stacked, spans)
    at_once = write_fp8_shard(tmp_path / "at_once.safetensors", stacked, spans, encode_threads=3)
    assert (at_once.digest, at_once.size) == (one.digest, one.size)


def test_the_kept_tensors_are_counted_at_their_stored_size_and_the_bytes_do_not_change(tmp_path):
    stacked, spans = captured_like(rows=60), [(0, 20), (20, 45), (45, 60)]
    free = write_fp8_shard(tmp_path / "free.safetensors", stacked, spans)
    kept = KeptBytes(1 << 30)
    room = kept.shard()
    counted = write_fp8_shard(tmp_path / "counted.safetensors", stacked, spans, encode_threads=3, room=room)
    header = read_header(tmp_path / "counted.safetensors")
    stored = sum(entry["shape"][0] for name, entry in header.items() if "/hidden_states/" in name)
    assert (counted.digest, counted.size) == (free.digest, free.size)
    assert room.held == kept.used == stored > 0
    room.close()
    assert kept.used == 0


def test_shards_past_the_limit_are_written_oldest_first_and_all_of_them_finish(tmp_path, monkeypatch):
    """With room for less than a shard, each shard waits for the ones before it to close: started youngest first,
    they still end oldest first, and every one is written as it would be alone."""
    stacked, spans = captured_like(rows=60), [(0, 20), (20, 45), (45, 60)]
    alone = write_fp8_shard(tmp_path / "alone.safetensors", stacked, spans)
    kept, ended, failures = KeptBytes(1), [], []
    rooms = [kept.shard() for _ in range(3)]  # capture order: shard 0 is the oldest

    def write(i):
        try:
            out = write_fp8_shard(tmp_path / f"{i}.safetensors", stacked, spans, room=rooms[i])
            ended.append((i, out.digest))
        except BaseException as exc:
            failures.append(exc)
        finally:
            rooms[i].close()

    waited, real_wait = set(), kept.changed.wait

    def wait(timeout=None):
        waited.add(threading.current_thread().name)
        return real_wait(timeout)

    monkeypatch.setattr(kept.changed, "wait", wait)
    threads = {i: threading.Thread(target=write, args=(i,), name=f"shard-{i}") for i in range(3)}
    for i in (2, 1):
        threads[i].start()
    deadline = time.monotonic() + 30
    while waited != {"shard-2", "shard-1"} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waited == {"shard-2", "shard-1"}, "the younger shards wait for room before the oldest begins"
    threads[0].start()
    for thread in threads.values():
        thread.join(30)
    assert not failures and ended == [(i, alone.digest) for i in range(3)]
    assert kept.used == 0


def test_a_failed_frame_returns_only_once_the_samples_other_frames_are_done(tmp_path, monkeypatch):
    """The caller gives a sample's pinned blocks back as soon as `write_many` returns or raises: a state whose
    framing fails must not leave its neighbours still reading them."""
    real, calls, finished = step_codecs.frame, [], []

    first = threading.Lock()

    def failing_once(codec_name, pieces):
        calls.append(pieces)
        if first.acquire(blocking=False):  # the first call on any of the encoder threads
            raise ValueError("refused")
        time.sleep(0.3)
        finished.append(pieces)
        return real(codec_name, pieces)

    monkeypatch.setattr(step_codecs, "frame", failing_once)
    step = fp8_encode_step(captured_like(rows=20))
    rows = step.host_rows(step.data, FP8.name)
    specs = sample_tensor_specs("s0", 20, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="tensors were not written"):
        with ShardFileWriter(tmp_path / "shard.safetensors", specs, FP8, encode_threads=3) as out:
            sample = {"s0/input_ids": [torch.arange(20, dtype=torch.int32)],
                      "s0/loss_mask": [torch.ones(20, dtype=torch.uint8)]}
            sample.update({f"s0/hidden_states/{slot}": [rows[slot][0:20]] for slot in range(3)})
            with pytest.raises(ValueError, match="refused"):
                out.write_many({name: sample[name] for name in out.order})
            assert len(calls) == 3 and len(finished) == 2
    assert list(tmp_path.iterdir()) == []
