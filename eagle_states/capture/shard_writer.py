"""The shard writers: a pool of threads on the writer rank, a shard's file written by one of them, sample by
sample in the file's order as the assembler completes them. Reads nothing of vLLM."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from eagle_states.capture.handoff import CapturedSample, ShardPlan
from eagle_states.capture.protocol import CaptureError
from eagle_states.dataset.kept_bytes import KeptBytes, ShardRoom
from eagle_states.dataset.layout import key_hidden_state, key_input_ids, key_loss_mask, shard_sample_order
from eagle_states.dataset.shard_file import ShardFileWriter, sample_tensor_specs

if TYPE_CHECKING:
    from eagle_states.capture.forward import PinnedPool

# ShardWriter's counters of where the writer threads' time goes (the stats reply's `writer_*` fields)
WRITER_TIMES = ("shard_s", "take_wait_s", "hash_s", "write_wait_s", "spill_read_s", "commit_s")


class ShardWriter:
    """Streams each sample from host memory to disk as soon as it is complete, and hands its pinned blocks back.
    Host memory is bounded by the pinned pool (CUDA) and, with a codec, by `kept_limit` bytes of compressed tensors
    kept until their shard's end (`kept_bytes`; the oldest shard in flight may pass it by its own bytes)."""

    def __init__(self, num_states: int, write_threads: int, pinned: PinnedPool, kept_limit: int):
        self.num_states = num_states  # captured layers: a hidden state per layer and sample
        self.pinned = pinned
        self.kept = KeptBytes(kept_limit)
        self.pool = ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="eagle-writer")
        self.write_slots = threading.BoundedSemaphore(write_threads + 1)
        self.lock = threading.Lock()
        self.encoded_bytes, self.encode_s = 0, 0.0  # summed over the writer threads
        # where the writer threads' time goes, summed over them and over written shards: in shards (from asking
        # for the first sample to the file committed), waiting for samples, hashing, waiting for the file's writes,
        # reading spill files back, and at the shard's end the rest of it (the header, fsync, rename)
        self.shard_s = self.take_wait_s = self.hash_s = self.write_wait_s = self.spill_read_s = self.commit_s = 0.0
        self.last_written = 0.0  # time.monotonic() when the last shard file was committed
        self.last_taken = 0.0  # time.monotonic() when a writer last got a complete sample

    def submit(self, path: str, plan: ShardPlan, take: Callable[[str], CapturedSample]) -> Future:
        """Start writing a shard whose samples `take` hands over as they are complete; waits (the assembler) while
        `write_threads + 1` shards are held for writing. The future gives the file's (digest, bytes)."""
        self.write_slots.acquire()
        return self.pool.submit(self._write_shard, path, plan, take, self.kept.shard())  # rooms in capture order

    def _write_shard(self, path: str, plan: ShardPlan, take: Callable[[str], CapturedSample],
                     room: ShardRoom) -> tuple[str, int]:
        started = time.monotonic()
        try:
            order = shard_sample_order(plan.sample_ids)
            first, waited = self._take(take, order[0])
            spilled = []  # with a step codec: spilled samples written, whose files the digest reads again at the end
            spill_read = [0.0]  # seconds reading this shard's spill files back (`_timed`)
            try:
                width, dtype = first.state_width_and_dtype()  # the stream's, from the first captured rows
                specs = {}
                for sid in order:
                    specs.update(sample_tensor_specs(sid, plan.num_tokens[sid], self.num_states, width, dtype))
                # a step codec's states of a sample framed at once (a copy and a CRC-32 each), so that the run's
                # last samples reach the file sooner; a CPU codec keeps to its threads (`extract.codec_threads`)
                framing = self.num_states if plan.codec.on_device else 1
                with ShardFileWriter(Path(path), specs, plan.codec, encode_threads=framing, kept=room) as out:
                    for sid in order:
                        sample, seconds = (first, 0.0) if sid == order[0] else self._take(take, sid)
                        waited += seconds
                        try:
                            self._write_sample(out, sid, sample, plan.loss_masks[sid], spill_read)
                        finally:
                            if sample.spill is not None and plan.codec.on_device:
                                spilled.append(sample)  # its spill file is read again for the digest at the end
                            else:
                                sample.forget(self.pinned)
                with self.lock:
                    self.encoded_bytes += out.encoded_bytes
                    # a CPU codec compresses a spilled state as it is read back: its time holds the reads
                    holds_reads = plan.codec.enabled and not plan.codec.on_device
                    self.encode_s += out.encode_s - (spill_read[0] if holds_reads else 0.0)
                    self.spill_read_s += spill_read[0]
                    self.commit_s += out.commit_s
                    self.last_written = time.monotonic()
                    self.shard_s += self.last_written - started
                    self.take_wait_s += waited
                    self.hash_s += out.hash_s
                    self.write_wait_s += out.write_wait_s
            finally:
                first.forget(self.pinned)  # a no-op once written; gives it back when the file could not be opened
                for sample in spilled:
                    sample.forget(self.pinned)
            return out.digest, out.size
        except OSError as exc:
            if exc.filename is None:  # "No space left on device" names no file; the user needs to know which disk
                raise OSError(exc.errno, exc.strerror, path) from exc
            raise
        finally:
            room.close()
            self.write_slots.release()

    def _take(self, take: Callable[[str], CapturedSample], sample_id: str) -> tuple[CapturedSample, float]:
        """A complete sample, and the seconds waited for it."""
        started = time.monotonic()
        sample = take(sample_id)
        self.last_taken = time.monotonic()  # a float store: no lock needed between the writer threads
        return sample, self.last_taken - started

    def _write_sample(self, out: ShardFileWriter, sample_id: str, sample: CapturedSample, mask: list[int],
                      spill_read: list[float]):
        if len(mask) != len(sample.ids):
            raise CaptureError(f"sample {sample_id}: loss mask of {len(mask)} for {len(sample.ids)} tokens")
        tensors = {key_input_ids(sample_id): [sample.ids.to(torch.int32)],
                   key_loss_mask(sample_id): [torch.tensor(mask, dtype=torch.uint8)]}
        if sample.spill is None:
            for slot in range(self.num_states):
                tensors[key_hidden_state(sample_id, slot)] = [chunk[slot] for chunk in sample.chunks]
            out.write_many({name: tensors[name] for name in sorted(tensors)})
            return
        spilled = {key_hidden_state(sample_id, slot): slot for slot in range(self.num_states)}
        for name in sorted([*tensors, *spilled]):  # the file's order, each state read back as it is written
            if name in spilled:
                stream = sample.spill.stream(spilled[name])
                out.write_streamed(name, dataclasses.replace(stream, pieces=_timed(stream.pieces, spill_read)))
            else:
                out.write_many({name: tensors[name]})


def _timed(make: Callable[[], Iterable], spent: list[float]) -> Callable[[], Iterator]:
    """`make`'s pieces, each one's making timed into spent[0] (a spill file read back), however often it is called
    (a step codec's state is streamed again for the digest)."""
    def pieces() -> Iterator:
        made = iter(make())
        while True:
            started = time.perf_counter()
            try:
                piece = next(made)
            except StopIteration:
                return
            finally:
                spent[0] += time.perf_counter() - started
            yield piece
    return pieces
