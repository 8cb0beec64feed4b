"""The benchmark command keeps working (its output's structure, never its speed), and the shard writer's
streaming to disk writes exactly the bytes it is given."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from eagle_states import contract


def test_bench_command_on_the_demo_model(llama_model, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "eagle_states", "bench", "--model", str(llama_model), "--out", str(out),
           "--prompts", "6", "--prompt-len", "40", "--rounds", "2", "--dtype", "float32",
           "--gpu-memory-utilization", "0.2", "--max-num-batched-tokens", "64", "--shard-max-tokens", "100",
           "--disk-probe-gb", "0.01", "--free-written", "--json", str(tmp_path / "bench.json")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    assert printed.count("round ") == 2
    for line in ("plain prefill", "capture to disk", "ratio capture/plain", "up to the last forward pass",
                 "GB/s written", "disk alone", "forward stalled", "after the last forward",
                 "device time in forward passes", "idle between them", "peak host RSS", "engine start"):
        assert line in printed or line.replace(" GB/s", "") in printed, line
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["tokens_per_round"] == 6 * 40 and len(result["rounds"]) == 2
    assert [r["first"] for r in result["rounds"]] == ["plain", "capture"]  # ABBA order
    assert result["layer_ids"] == [2, 4, 5, 8] and result["bytes_per_token"] == 4 * 4 * 256  # fp32, 4 layers, H=256
    for r in result["rounds"]:
        assert r["ratio"] == pytest.approx(r["plain_s"] / r["capture_s"])
        assert r["ratio_to_last_forward"] == pytest.approx(r["plain_s"] / (r["capture_s"] - r["drain_s"]))
        # 3 shards of 2 samples: every state written, plus ids, masks and headers
        assert r["bytes_written"] > 240 * result["bytes_per_token"]
        assert 0 <= r["setup_s"] < r["capture_s"] and 0 <= r["drain_s"] < r["capture_s"]
        assert r["forward_stalled_s"] == 0  # no pinned host buffers on the CPU build
        # 240 tokens in steps of at most 64: plain packs them into 4 steps; capture runs 3 shards of 2 samples
        # (80 tokens each: 2 steps per shard)
        assert r["plain_forwards"] == 4 and r["capture_forwards"] == 6
        for mode in ("plain", "capture"):
            assert 0 < r[f"{mode}_forward_s"] and 0 <= r[f"{mode}_between_forwards_s"]
            assert r[f"{mode}_forward_s"] + r[f"{mode}_between_forwards_s"] < r[f"{mode}_s"]
    assert result["disk_write_gb_s"] > 0 and result["peak_host_rss_gb"] > 0
    assert not (out / "dataset").exists()  # each round's dataset is removed
    assert result["free_written"] is True


def test_free_disk_blocks_keeps_the_size_and_gives_the_blocks_back(tmp_path):
    from eagle_states.bench import free_disk_blocks

    path = tmp_path / "shard.bin"
    contract.atomic_write_bytes(path, os.urandom(8 << 20))
    assert path.stat().st_blocks * 512 >= 8 << 20
    free_disk_blocks(path)
    assert path.stat().st_size == 8 << 20 and path.stat().st_blocks * 512 < 1 << 20
    assert path.read_bytes() == bytes(8 << 20)  # a hole reads as zeros


def test_streaming_file_writes_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(contract.StreamingFile, "WRITEBACK_BYTES", 4096)  # hand ranges to the disk often
    pieces = [os.urandom(n) for n in (1, 4095, 4097, 10_000, 65_536, 3)]
    pieces.append(torch.arange(5000, dtype=torch.int32).view(torch.uint8).numpy())
    with contract.atomic_file(tmp_path / "f.bin") as f:
        for piece in pieces:
            f.write(piece)
        assert f.handed > 0 and f.previous is not None
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    data = (tmp_path / "f.bin").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256(expected).digest()
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with contract.atomic_file(tmp_path / "f.bin") as f:
            f.write(b"x" * 100)
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []


def test_direct_file_writes_every_byte_across_buffers_and_an_unaligned_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(contract.DirectFile, "CHUNK", 2 * contract.DirectFile.ALIGN)  # switch buffers often
    pieces = [os.urandom(n) for n in (1, 4095, 4097, 10_000, 65_536, 8192, 3)]
    pieces.append(torch.arange(5000, dtype=torch.int32).view(torch.uint8).numpy())
    with contract.atomic_file(tmp_path / "f.bin", direct=True) as f:
        assert isinstance(f, contract.DirectFile), "this filesystem refused O_DIRECT"
        for piece in pieces:
            f.write(piece)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_failed_direct_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with contract.atomic_file(tmp_path / "f.bin", direct=True) as f:
            f.write(os.urandom(contract.DirectFile.CHUNK + 100))  # one buffer on its way to the disk
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []
