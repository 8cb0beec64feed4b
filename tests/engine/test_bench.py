"""The benchmark command keeps working (its output's structure, never its speed)."""

import json
import subprocess
import sys

import pytest

from eagle_states.bench import disk_bytes_written
from eagle_states.dataset.files import tmpfs_huge_pages
from helpers import REPO


def test_bench_command_on_the_demo_model(llama_model, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "eagle_states", "bench", "--model", str(llama_model), "--out", str(out),
           "--prompts", "6", "--prompt-len", "40", "--rounds", "2", "--dtype", "float32",
           "--gpu-memory-utilization", "0.2", "--max-num-batched-tokens", "50", "--max-num-seqs", "8",
           "--shard-max-tokens", "100", "--codecs", "none,blosc2-zstd",
           "--disk-probe-gb", "0.01", "--free-written", "--spill-dir", str(tmp_path / "spill"),
           "--json", str(tmp_path / "bench.json")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    assert printed.count("round ") == 2
    for line in ("plain prefill", "capture to disk, codec none", "capture to disk, codec blosc2-zstd",
                 "ratio capture/plain", "up to the last forward pass", "GB/s written", "bytes/token on disk",
                 "GB/s per writer thread", "disk alone", "forward stalled", "after the last forward",
                 "device time in forward passes", "idle between them", "host RSS of this process and the engine's",
                 "engine start", "allows at most"):
        assert line in printed or line.replace(" GB/s", "") in printed, line
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["tokens_per_round"] == 6 * 40 and len(result["rounds"]) == 2
    # each round starts with the next in turn
    assert [r["order"] for r in result["rounds"]] == [["plain", "none", "blosc2-zstd"],
                                                     ["none", "blosc2-zstd", "plain"]]
    assert result["layer_ids"] == [2, 4, 5, 8] and result["bytes_per_token"] == 4 * 4 * 256  # fp32, 4 layers, H=256
    for r in result["rounds"]:
        assert 0 < r["plain_forward_s"] and 0 <= r["plain_between_forwards_s"]
        assert r["plain_forward_s"] + r["plain_between_forwards_s"] < r["plain_s"]
        plain, packed = r["captures"]["none"], r["captures"]["blosc2-zstd"]
        for c in (plain, packed):
            assert c["ratio"] == pytest.approx(r["plain_s"] / c["capture_s"])
            assert c["ratio_to_last_forward"] == pytest.approx(r["plain_s"] / (c["capture_s"] - c["drain_s"]))
            assert 0 <= c["setup_s"] < c["capture_s"] and 0 <= c["drain_s"] < c["capture_s"]
            assert c["forward_stalled_s"] == 0  # no pinned host buffers on the CPU build
            assert c["drain_backlog_gb"] == 0  # (nor a backlog in them)
            assert c["spilled_gb"] == 0  # samples of 40 tokens fit 8 GiB
            # the last sample reaches its writer after the last step, its shard is written after that and recorded
            # by the driver (its receipt) before the index and the manifest
            assert (0 <= c["drain_assembled_s"] <= c["drain_writes_s"] <= c["drain_recorded_s"] <= c["drain_s"]
                    and c["drain_writes_s"] > 0)
            # 240 tokens in steps of at most 50: plain packs them into 5 steps; capture runs 3 shards of 2
            # samples (80 tokens each: 2 steps per shard)
            assert r["plain_forwards"] == 5 and c["capture_forwards"] == 6
            # the writer threads' time in the 3 shards, and the parts of it that are counted: each within it
            assert c["shards"] == 3 and c["writers_shard_s"] > 0 and c["writers_hash_s"] > 0
            assert min(c["writers_take_wait_s"], c["writers_write_wait_s"]) >= 0 and c["writers_commit_s"] > 0
            assert c["writers_spill_read_s"] == 0  # no sample spilled (`test_spill.py` times one that is)
            assert (c["writers_take_wait_s"] + c["writers_hash_s"] + c["writers_write_wait_s"] + c["writers_commit_s"]
                    <= c["writers_shard_s"] + 1e-6)
            assert 0 < c["capture_forward_s"] and 0 <= c["capture_between_forwards_s"]
            assert c["capture_forward_s"] + c["capture_between_forwards_s"] < c["capture_s"]
        # 3 shards of 2 samples: every state written, plus ids, masks and headers; compressed: fewer bytes
        assert plain["bytes_written"] > 240 * result["bytes_per_token"] > packed["bytes_written"]
        assert plain["encoded_bytes"] == 0 and packed["encoded_bytes"] == 240 * result["bytes_per_token"]
        assert packed["encode_s"] > 0 and packed["bytes_per_token_stored"] == packed["bytes_written"] / 240
    assert result["captures"]["blosc2-zstd"]["compression_ratio"] > 1
    # the disk's bound on each codec: the disk's bytes a second over the bytes a token at plain prefill's pace
    for c in result["captures"].values():
        assert c["disk_bound_ratio"] == pytest.approx(
            result["disk_write_gb_s"] * 1e9 / (result["plain_tok_s_median"] * c["bytes_per_token_stored_median"]))
    # what the disk took while each capture ran, where the kernel counts it (none in memory): its shards at least
    counted = disk_bytes_written(out) is not None
    for c in (c for r in result["rounds"] for c in r["captures"].values()):
        assert c["disk_gb"] * 1e9 >= c["bytes_written"] if counted else c["disk_gb"] is None
    assert printed.count("the disk took") == (2 if counted else 0)  # a line per codec
    for c in result["captures"].values():  # and the disk's bound at all it took, no higher than at the shards'
        assert (c["disk_taken_bound_ratio"] <= c["disk_bound_ratio"] * 1.001 if counted
                else c["disk_taken_bound_ratio"] is None)
    assert result["disk_write_gb_s"] > 0 and result["peak_host_rss_gb"] > 0
    assert result["peak_tree_rss_gb"] >= result["loaded_tree_rss_gb"] > 0 and result["host_buffer_gb"] == 8
    assert result["spill_dir"] == str(tmp_path / "spill")  # samples of 40 tokens fit: nothing spilled there
    # a codec's kept tensors: the setting, and the oldest shard at the largest bytes a token stored: the largest
    # planned, 2 samples of 40 tokens (not shard_max_tokens, 100: a longer sample would be a shard of its own)
    assert result["largest_shard_tokens"] == 80
    assert result["kept_bound_gb"] == pytest.approx(
        (8 * 2**30 + 80 * result["captures"]["blosc2-zstd"]["bytes_per_token_stored_median"]) / 1e9)
    assert "above the loaded engine" in printed
    assert printed.count("a writer thread's time in a shard (the mean of 3)") == 2  # a line per codec
    # the drain's backlog counts pinned buffers only: said for the codec (whose framed tensors queue for the disk
    # beyond them), not for none
    assert printed.count("still queued for the disk are not counted") == 1
    assert not (out / "dataset").exists()  # each round's dataset is removed
    # into RAM, the bench says so and with which pages (tests/unit/test_files.py mounts tmpfs both ways)
    tmpfs = tmpfs_huge_pages(out)
    assert result["output_tmpfs"] == (dict(mount=tmpfs[0], huge=tmpfs[1]) if tmpfs else None)
    assert ("into tmpfs (" in printed) == bool(tmpfs)
    assert result["free_written"] is True
