"""Benchmark: plain prefill against the full extraction (states on disk, manifest and all), with each codec asked
for, interleaved in one process on one engine, so all see the same model, settings, prompts and machine state.

Plain prefill is `llm.generate(..., max_tokens=1)` without sample ids: the capture hooks stay idle, which is
what vLLM does without this project. Capture is `Extraction.run` into a fresh directory each round, once per
codec (the codec is the shard writers', so one engine serves them all), from the prompts as `prepare` leaves them
for `extract` (its samples table, read and checked again each round). Each round starts with the next one in
turn, so a drift of the machine's speed favours none of them.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle_states.capture.engine import EngineHolder
from eagle_states.capture.shard_writer import WRITER_TIMES
from eagle_states.config import PipelineParams
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.files import atomic_file, libc_function, tmpfs_huge_pages, without_huge_pages
from eagle_states.dataset.layout import shard_path
from eagle_states.dataset.prepared import write_samples
from eagle_states.extraction.driver import Extraction


def write_like_a_shard(path: Path, total_bytes: int, block, direct: bool = True) -> None:
    """`total_bytes` of `block` repeated, written the way shards are (`files.atomic_file`: past the page cache
    where the filesystem allows, fsynced, renamed); `direct=False`: buffered and streamed to the disk as it goes."""
    with atomic_file(path, direct=direct) as f:
        for _ in range(total_bytes // len(block)):
            f.write(block)


def disk_write_bandwidth(directory: Path, total_bytes: int = 2 << 30, streams: int = 1,
                         block: int = 64 << 20) -> float:
    """GB/s of sequential writes + fsync into `directory`, `streams` files at once (as many as the capture has
    writer threads: a filesystem in memory takes several files 3-4 x faster than one), written the way shards are
    but with nothing else running: the bound on the capture's write speed."""
    from concurrent.futures import ThreadPoolExecutor

    probes = [directory / f".bench-disk-probe-{i}" for i in range(streams)]
    per_stream = total_bytes // streams
    data = os.urandom(min(block, per_stream))
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="bench-probe") as pool:
            for done in [pool.submit(write_like_a_shard, probe, per_stream, data) for probe in probes]:
                done.result()
        elapsed = time.perf_counter() - started
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
    written = per_stream // len(data) * len(data) * streams
    return written / elapsed / 1e9


def disk_bytes_written(directory: Path) -> int | None:
    """What the block device under `directory` has written since it started, by the kernel's count (all files on
    it, written back from the page cache or not); None where there is no such device (a tmpfs, an overlay)."""
    dev = os.stat(directory).st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    return int(fields[6]) * 512  # sectors written, of 512 bytes whatever the device's own


_FALLOC_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01


def free_disk_blocks(path: Path) -> None:
    """Give a written file's blocks back to the filesystem without changing its size (a hole punched over all of
    it), so that a round can write more than the disk holds. Only the bench does this, after the shard was
    fsynced and its receipt written, in a thread of its own so that the engine's loop never waits for it. It slows
    the disk for the writes beside it (on one H200: the capture's writers at 1.18 GB/s with it, 1.30 without)."""
    import ctypes

    fallocate = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long])
    if fallocate is None:
        raise OSError(f"no fallocate in this C library: --free-written cannot punch {path}")
    fd = os.open(path, os.O_WRONLY)
    try:
        if fallocate(fd, _FALLOC_PUNCH_HOLE_KEEP_SIZE, 0, os.fstat(fd).st_size) != 0:
            raise OSError(ctypes.get_errno(), f"fallocate(PUNCH_HOLE) on {path}")
    finally:
        os.close(fd)


class TreeRss:
    """Peak resident memory of this process and its children (vLLM's engine core, where the capture and its pinned
    buffers live, is a child: `getrusage(RUSAGE_SELF)` never sees it), sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.05):
        import threading

        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)

    def now(self) -> int:
        import psutil

        me = psutil.Process()
        total = 0
        for proc in (me, *me.children(recursive=True)):
            try:
                total += proc.memory_info().rss
            except psutil.Error:  # a child that just ended
                pass
        self.peak = max(self.peak, total)
        return total

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.now()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _peak_gpu_bytes() -> int | None:
    try:
        import torch

        return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None
    except Exception:
        return None


# torch's caching allocator on CUDA: a cudaFree, and a cudaMalloc retried after emptying the cache, wait for the
# whole device (holding the GIL, which stops the thread launching the model's kernels)
ALLOCATOR_WAITS = ("num_device_free", "num_alloc_retries")


def _allocator_waits() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_WAITS}


def random_prompts(model: Path, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Token ids drawn uniformly from the model's vocabulary (the first ten left out: special tokens)."""
    import random

    rng = random.Random(seed)
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1000)
    return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]


def write_prompts(directory: Path, prompts: list[list[int]]) -> None:
    """An extraction input as `prepare` leaves it for `extract` (its samples table), row i with the id b{i:06d},
    every token a loss token."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_samples(directory, [{"sample_id": f"b{i:06d}", "source_row": i + 1, "input_ids": p,
                               "loss_mask": [1] * len(p), "num_tokens": len(p), "num_loss_tokens": len(p)}
                              for i, p in enumerate(prompts)])


def _steps(mode: str, before, after) -> dict:
    """Forward passes in a run, the device's time in them, and its idle time between them (scheduling, sampling,
    and in capture mode the shard boundaries and anything else that holds up the engine's loop)."""
    return {f"{mode}_{key}": getattr(after, key) - getattr(before, key)
            for key in ("forwards", "forward_s", "between_forwards_s")}


def _allocator(mode: str, before: dict) -> dict:
    """cudaFree calls and retried cudaMallocs in a run (an engine in this process only)."""
    return {f"{mode}_{key}": value - before[key] for key, value in _allocator_waits().items()}


class _Bench:
    """One loaded engine and the bench's prompts: plain prefill and a capture per codec, a round at a time."""

    def __init__(self, params: PipelineParams, out_dir: Path, prompts: list[list[int]], codec: str,
                 free_written: bool):
        self.params, self.prompts, self.free_written = params, prompts, free_written
        self.tokens = sum(len(p) for p in prompts)
        self.source, self.warm_source = out_dir / "prompts", out_dir / "warm-up-prompts"
        self.target, self.warm_target = out_dir / "dataset", out_dir / "warm-up"
        self.warm_prompts = prompts[: max(1, len(prompts) // 8)]
        write_prompts(self.source, prompts)
        write_prompts(self.warm_source, self.warm_prompts)
        self.holder = EngineHolder()
        started = time.perf_counter()
        self.extraction = self.extraction_of(self.source, self.target, codec)  # the model, layers and shards
        self.engine = self.holder(self.extraction.engine_settings())
        self.engine_start_s = time.perf_counter() - started
        self.rss = TreeRss()  # a daemon thread: a bench that fails leaves it to the interpreter's end
        self.rss.start()
        self.loaded_rss = self.rss.now()

    def extraction_of(self, src: Path, target: Path, codec: str) -> Extraction:
        return Extraction(self.params.override({"extract.input": str(src), "output.dir": str(target),
                                                "extract.codec": codec}))

    def warm(self, codecs: list[str]) -> None:
        """Both paths on an eighth of the prompts (allocator, pinned host buffers, writer threads, page cache),
        before anything is timed."""
        self.engine.plain_prefill(self.warm_prompts)
        for codec in codecs:
            self.extraction_of(self.warm_source, self.warm_target, codec).run(self.holder)
            shutil.rmtree(self.warm_target)

    def round(self, r: int, codecs: list[str]) -> dict:
        """Plain prefill and every capture once, starting with the next in turn (with one codec: ABBA), so that a
        drift of the machine's speed favours none of them."""
        turns = ["plain", *codecs]
        order = turns[r % len(turns):] + turns[:r % len(turns)]
        row = {"round": r, "first": "plain" if order[0] == "plain" else "capture", "order": order, "captures": {}}
        for turn in order:
            if turn == "plain":
                row.update(self.plain())
            else:
                row["captures"][turn] = self.capture(turn)
        for c in row["captures"].values():
            c.update(ratio=row["plain_s"] / c["capture_s"],
                     # the same without what is left to write after the last forward pass: a fixed cost per run,
                     # which a long run (hours, not this round's seconds) spreads over many more tokens
                     ratio_to_last_forward=row["plain_s"] / (c["capture_s"] - c["drain_s"]))
        row["plain_tok_s"] = self.tokens / row["plain_s"]
        return row

    def plain(self) -> dict:
        before, allocator_before = self.engine.capture_stats(), _allocator_waits()
        t0 = time.monotonic()
        self.engine.plain_prefill(self.prompts)
        plain_s = time.monotonic() - t0
        return {"plain_s": plain_s, **_steps("plain", before, self.engine.capture_stats()),
                **_allocator("plain", allocator_before)}

    def capture(self, codec: str) -> dict:
        target = self.target
        shutil.rmtree(target, ignore_errors=True)
        before, allocator_before = self.engine.capture_stats(), _allocator_waits()
        disk_before = disk_bytes_written(target.parent)
        t0 = time.monotonic()
        extraction = self.extraction_of(self.source, target, codec)  # reads and hashes the input, plans shards
        setup_s = time.monotonic() - t0
        freed, recorded = [], [0.0]  # recorded: when the driver last recorded a shard (its receipt written)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-free") as freeing:
            def on_shard(shard, cached):
                recorded[0] = time.monotonic()
                if self.free_written:
                    freed.append(freeing.submit(free_disk_blocks, shard_path(target, shard.name)))
            manifest = extraction.run(self.holder, on_shard)
            ended = time.monotonic()
        for done in freed:
            done.result()
        disk_after = disk_bytes_written(target.parent)
        after = self.engine.capture_stats()
        shutil.rmtree(target, ignore_errors=True)
        # where the capture's extra time goes: reading the input, the forward pass waiting for host buffers
        # (back-pressure from writing), the time after the last captured step (writes draining, manifest), and
        # the device's time in and between forward passes (compared with plain prefill's)
        capture_s = ended - t0
        row = {"capture_s": capture_s, "bytes_written": sum(s["bytes"] for s in manifest["shards"]),
               # what the disk itself took meanwhile: the shards, and spill files the kernel wrote back
               "disk_gb": None if disk_before is None else (disk_after - disk_before) / 1e9,
               "setup_s": setup_s, "forward_stalled_s": after.pinned_wait_s - before.pinned_wait_s,
               "drain_s": ended - after.last_forward_end, **_steps("capture", before, after),
               # the drain taken apart: what the host buffers still held when the last step was handed over, and
               # when the last shard file was committed (the rest is the index, the manifest, the driver's polls)
               "drain_backlog_gb": after.backlog_bytes / 1e9,
               "drain_writes_s": max(0.0, after.last_shard_written - after.last_forward_end),
               "drain_assembled_s": max(0.0, after.last_sample_taken - after.last_forward_end),
               "drain_recorded_s": max(0.0, recorded[0] - after.last_forward_end),  # then index and manifest
               "encoded_bytes": after.encoded_bytes - before.encoded_bytes,
               "encode_s": after.encode_s - before.encode_s,
               "device_encoded_bytes": after.device_encoded_bytes - before.device_encoded_bytes,
               "device_encode_s": after.device_encode_s - before.device_encode_s,
               # states of samples too long for the host buffer, through spill files (`capture.spill`)
               "spilled_gb": (after.spilled_bytes - before.spilled_bytes) / 1e9,
               # the writer threads' time (summed over them): in shards, waiting for samples, hashing, waiting for
               # the file's writes, reading spill files back, committing; the rest of it is framing or encoding and
               # opening
               **{f"writers_{key}": getattr(after, f"writer_{key}") - getattr(before, f"writer_{key}")
                  for key in WRITER_TIMES},
               "shards": len(manifest["shards"]),
               **_allocator("capture", allocator_before)}
        row.update(capture_tok_s=self.tokens / capture_s, write_gb_s=row["bytes_written"] / capture_s / 1e9,
                   bytes_per_token_stored=row["bytes_written"] / self.tokens,
                   # the codec's own speed: what one writer thread compresses per second (codec_threads each)
                   encode_gb_s_per_writer=(row["encoded_bytes"] / row["encode_s"] / 1e9 if row["encode_s"] else None),
                   # a step codec's: what the device encodes per second of its own time
                   encode_gb_s_device=(row["device_encoded_bytes"] / row["device_encode_s"] / 1e9
                                       if row["device_encode_s"] else None))
        return row

    def close(self) -> None:
        self.holder.close()
        self.rss.stop()


def _round_lines(row: dict) -> str:
    """A round as it is printed when it ends: plain prefill's pace, then each capture's, with where its time went."""
    lines = [f"round {row['round']} ({', '.join(row['order'])}): plain {row['plain_tok_s']:,.0f} tok/s"]
    for codec, c in row["captures"].items():
        lines.append(
            f"  capture {codec}: {c['capture_tok_s']:,.0f} tok/s | ratio {c['ratio']:.3f} | "
            f"{c['write_gb_s']:.2f} GB/s written, {c['bytes_per_token_stored']:,.0f} bytes/token | input "
            f"{c['setup_s']:.1f} s, forward stalled {c['forward_stalled_s']:.1f} s, after the last forward "
            f"{c['drain_s']:.2f} s ({c['drain_backlog_gb']:.2f} GB in pinned host buffers, the last sample "
            f"at its writer after {c['drain_assembled_s']:.2f} s, the last shard written after "
            f"{c['drain_writes_s']:.2f} s, recorded after {c['drain_recorded_s']:.2f} s) | steps "
            f"{row['plain_forwards']} / {c['capture_forwards']}, "
            f"in them {row['plain_forward_s']:.2f} s / {c['capture_forward_s']:.2f} s, idle between them "
            f"{row['plain_between_forwards_s']:.2f} s / {c['capture_between_forwards_s']:.2f} s (plain / capture)"
            + "".join(f" | {key} {row[f'plain_{key}']} / {c[f'capture_{key}']}" for key in ALLOCATOR_WAITS
                      if f"capture_{key}" in c))
    return "\n".join(lines)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_benchmark(params: PipelineParams, out_dir: Path, *, num_prompts: int, prompt_len: int, rounds: int,
                  disk_probe_bytes: int, free_written: bool = False, seed: int = 0,
                  codecs: list[str] | None = None) -> dict:
    """`params`: the model and the extract settings (the bench's own prompts replace the input); `codecs`: the
    captures to measure beside plain prefill (default: extract.codec alone)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    e = params.extract
    codecs = codecs or [e.codec]
    bench = _Bench(params, out_dir, random_prompts(Path(params.model.path), num_prompts, prompt_len, seed),
                   codecs[0], free_written)
    rounds_out = []
    try:
        bench.warm(codecs)
        for r in range(rounds):
            rounds_out.append(bench.round(r, codecs))
            print(_round_lines(rounds_out[-1]), flush=True)
    finally:
        bench.close()
    disk = disk_write_bandwidth(out_dir, disk_probe_bytes, streams=e.write_threads)
    tmpfs = tmpfs_huge_pages(out_dir)  # shards into RAM: the filesystem's pages
    extraction = bench.extraction
    raw_bytes_per_token = ((4 if extraction.dtype == "float32" else 2) * extraction.model["hidden_size"]
                           * len(extraction.layers))
    captures = {}
    for codec in codecs:
        rows = [r["captures"][codec] for r in rounds_out]
        captures[codec] = {f"{k}_median": _median(c[k] for c in rows) for k in (
            "capture_tok_s", "ratio", "ratio_to_last_forward", "write_gb_s", "setup_s", "forward_stalled_s",
            "drain_s", "drain_assembled_s", "drain_writes_s", "drain_recorded_s", "drain_backlog_gb",
            "capture_forward_s", "capture_between_forwards_s", "bytes_per_token_stored", "encode_gb_s_per_writer",
            "encode_gb_s_device", "spilled_gb", "disk_gb", *(f"writers_{key}" for key in WRITER_TIMES))}
        captures[codec]["shards"] = rows[0]["shards"]
        captures[codec]["compression_ratio"] = raw_bytes_per_token / captures[codec]["bytes_per_token_stored_median"]
    plain_tok_s = statistics.median(r["plain_tok_s"] for r in rounds_out)
    for c in captures.values():
        # the most any capture storing these bytes a token could reach against plain prefill with this disk (a
        # run of hours, the drain spread out): past it, the disk is the bound and not the capture
        c["disk_bound_ratio"] = disk * 1e9 / (plain_tok_s * c["bytes_per_token_stored_median"])
        # the same at the bytes the disk itself took while the capture ran (shards, and spill files written back)
        c["disk_taken_bound_ratio"] = (disk * bench.tokens / (plain_tok_s * c["disk_gb_median"])
                                       if c["disk_gb_median"] else None)
    # what a CUDA capture may hold above the loaded engine (its pinned pool reserved by then): with a codec, the
    # stored tensors kept until their shard's end, up to extract.host_buffer_gb, and the oldest shard's beyond it
    # (`dataset.kept_bytes`), the largest planned: a sample longer than shard_max_tokens is a shard of its own;
    # None when no codec keeps anything
    kept = [c["bytes_per_token_stored_median"] for codec, c in captures.items() if Codec(codec).enabled]
    largest_shard_tokens = max(shard.num_tokens for shard in extraction.shards)
    kept_bound_gb = (e.host_buffer_gb * 2**30 + largest_shard_tokens * max(kept)) / 1e9 if kept else None
    return {
        "model": str(params.model.path), "prompts": num_prompts, "prompt_len": prompt_len,
        "tokens_per_round": bench.tokens, "layer_ids": list(extraction.layers.layer_ids), "dtype": extraction.dtype,
        "hidden_size": extraction.model["hidden_size"], "bytes_per_token": raw_bytes_per_token,
        "max_num_batched_tokens": e.max_num_batched_tokens, "max_num_seqs": e.max_num_seqs,
        "shard_max_tokens": e.shard_max_tokens, "largest_shard_tokens": largest_shard_tokens,
        "write_threads": e.write_threads,
        "codec_level": e.codec_level, "codec_threads": e.codec_threads, "free_written": free_written,
        "rounds": rounds_out, "codecs": codecs,
        "plain_tok_s_median": plain_tok_s,
        **{f"{k}_median": statistics.median(r[k] for r in rounds_out)
           for k in ("plain_forward_s", "plain_between_forwards_s")},
        "captures": captures,
        "disk_write_gb_s": disk, "engine_start_s": bench.engine_start_s,
        "output_tmpfs": dict(zip(("mount", "huge"), tmpfs)) if tmpfs else None,
        "peak_host_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "loaded_tree_rss_gb": bench.loaded_rss / 1e9, "peak_tree_rss_gb": bench.rss.peak / 1e9,
        "host_buffer_gb": e.host_buffer_gb, "spill_dir": e.spill_dir, "kept_bound_gb": kept_bound_gb,
        "peak_gpu_reserved_gb": (_peak_gpu_bytes() or 0) / 1e9 or None,
    }


def format_result(result: dict) -> str:
    lines = [
        f"model {result['model']} ({result['dtype']}, hidden {result['hidden_size']}, layers {result['layer_ids']})",
        f"{result['prompts']} prompts x {result['prompt_len']} tokens per round, {len(result['rounds'])} rounds, "
        f"max_num_batched_tokens {result['max_num_batched_tokens']}, shards of {result['shard_max_tokens']:,} "
        f"tokens, {result['write_threads']} writer threads, codec level {result['codec_level']} with "
        f"{result['codec_threads']} threads per writer",
        f"plain prefill   {result['plain_tok_s_median']:>12,.0f} tokens/s (median); device time in forward passes "
        f"{result['plain_forward_s_median']:.2f} s, idle between them "
        f"{result['plain_between_forwards_s_median']:.2f} s",
    ]
    for codec, c in result["captures"].items():
        encode = (f", the codec {c['encode_gb_s_per_writer_median']:.2f} GB/s per writer thread"
                  if c["encode_gb_s_per_writer_median"] else
                  f", the codec {c['encode_gb_s_device_median']:.1f} GB/s on the device"
                  if c.get("encode_gb_s_device_median") else "")
        writer = {key: c[f"writers_{key}_median"] / c["shards"] for key in WRITER_TIMES}  # a writer, a shard
        rest = writer["shard_s"] - sum(writer[key] for key in WRITER_TIMES if key != "shard_s")
        lines += [
            f"capture to disk, codec {codec}: {c['capture_tok_s_median']:>12,.0f} tokens/s (median)",
            f"  ratio capture/plain {c['ratio_median']:.3f} (up to the last forward pass, without the writes "
            f"still draining then: {c['ratio_to_last_forward_median']:.3f})",
            f"  capture's extra time (median): input read and planned {c['setup_s_median']:.2f} s, forward stalled "
            f"on host buffers {c['forward_stalled_s_median']:.2f} s, after the last forward pass (writes draining, "
            f"index, manifest) {c['drain_s_median']:.2f} s: the last sample at its writer after "
            f"{c['drain_assembled_s_median']:.2f} s, the last shard written after {c['drain_writes_s_median']:.2f} s "
            f"and recorded by the driver after {c['drain_recorded_s_median']:.2f} s (then the index and the manifest), "
            f"with {c['drain_backlog_gb_median']:.2f} GB still in pinned host buffers when the last step was handed "
            f"over" + (" (a codec's stored tensors still queued for the disk are not counted)" if Codec(codec).enabled
                       else ""),
            f"  device time in forward passes {c['capture_forward_s_median']:.2f} s, idle between them "
            f"{c['capture_between_forwards_s_median']:.2f} s",
            f"  a writer thread's time in a shard (the mean of {c['shards']}): {writer['shard_s']:.3f} s, of it "
            f"waiting for samples {writer['take_wait_s']:.3f} s, hashing {writer['hash_s']:.3f} s, waiting for the "
            f"file's writes {writer['write_wait_s']:.3f} s, reading spill files back {writer['spill_read_s']:.3f} s, "
            f"committing (the header, fsync, rename) {writer['commit_s']:.3f} s, the rest (framing or encoding, "
            f"opening) {rest:.3f} s",
            f"  written {c['write_gb_s_median']:.2f} GB/s, {c['bytes_per_token_stored_median']:,.0f} bytes/token on "
            f"disk of {result['bytes_per_token']:,} captured (x{c['compression_ratio']:.3f}){encode}",
            f"  the disk alone ({result['disk_write_gb_s']:.2f} GB/s) allows at most {c['disk_bound_ratio']:.3f} x "
            f"plain prefill at these bytes/token",
        ]
        if c["spilled_gb_median"]:
            lines.append(f"  {c['spilled_gb_median']:.2f} GB of states went through spill files "
                         f"{'in ' + result['spill_dir'] if result['spill_dir'] else 'beside the shards'} (samples too "
                         f"long for extract.host_buffer_gb {result['host_buffer_gb']:g}): written, and read back "
                         + ("twice (the digest reads them again)" if Codec(codec).on_device else "once"))
        if c["disk_taken_bound_ratio"] is not None:
            shards = c["bytes_per_token_stored_median"] * result["tokens_per_round"] / 1e9
            lines.append(f"  the disk took {c['disk_gb_median']:.2f} GB while it ran, the shards {shards:.2f} GB of "
                         f"them (the rest: spill files the kernel wrote back before they were removed, other files); "
                         f"at all it took, the disk alone allows at most {c['disk_taken_bound_ratio']:.3f} x")
    lines += [
        f"disk alone {result['disk_write_gb_s']:.2f} GB/s ({result['write_threads']} files at once, as many as the "
        f"writer threads)",
    ]
    if tmpfs := result.get("output_tmpfs"):
        lines.append(f"  into tmpfs ({tmpfs['mount']}, huge={tmpfs['huge']})" + (
            f": {without_huge_pages(tmpfs['mount'])}" if tmpfs["huge"] == "never" else ""))
    lines += [
        f"host RSS of this process and the engine's: {result['loaded_tree_rss_gb']:.1f} GB with the model loaded, "
        f"peak {result['peak_tree_rss_gb']:.1f} GB (extract.host_buffer_gb {result['host_buffer_gb']:g}); "
        f"this process alone: peak {result['peak_host_rss_gb']:.1f} GB"
        + (f", peak GPU reserved {result['peak_gpu_reserved_gb']:.1f} GB" if result['peak_gpu_reserved_gb'] else ""),
    ]
    if result.get("kept_bound_gb"):
        lines.append(
            f"  above the loaded engine: {result['peak_tree_rss_gb'] - result['loaded_tree_rss_gb']:.1f} GB at the "
            f"peak; with a codec a CUDA capture keeps at most {result['kept_bound_gb']:.1f} GB there (the compressed "
            f"tensors up to extract.host_buffer_gb, and the oldest shard's {result['largest_shard_tokens']:,} tokens "
            f"beyond it)")
    lines.append(f"engine start {result['engine_start_s']:.1f} s")
    return "\n".join(lines)
