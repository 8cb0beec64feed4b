"""The benchmark command keeps working (its output's structure, never its speed)."""

import json
import subprocess
import sys

import pytest

from helpers import REPO


def test_bench_command_on_the_demo_model(llama_model, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "eagle_states", "bench", "--model", str(llama_model), "--out", str(out),
           "--prompts", "6", "--prompt-len", "40", "--rounds", "2", "--dtype", "float32",
           "--gpu-memory-utilization", "0.2", "--max-num-batched-tokens", "50", "--max-num-seqs", "8",
           "--shard-max-tokens", "100",
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
        # 240 tokens in steps of at most 50: plain packs them into 5 steps; capture runs 3 shards of 2 samples
        # (80 tokens each: 2 steps per shard)
        assert r["plain_forwards"] == 5 and r["capture_forwards"] == 6
        for mode in ("plain", "capture"):
            assert 0 < r[f"{mode}_forward_s"] and 0 <= r[f"{mode}_between_forwards_s"]
            assert r[f"{mode}_forward_s"] + r[f"{mode}_between_forwards_s"] < r[f"{mode}_s"]
    assert result["disk_write_gb_s"] > 0 and result["peak_host_rss_gb"] > 0
    assert not (out / "dataset").exists()  # each round's dataset is removed
    assert result["free_written"] is True
