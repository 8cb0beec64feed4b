"""The sample assembler: one thread, off the forward path, that maps each step's rows to samples and follows the
driver's shard markers, in the order the forward thread and the driver queued them.

It reads nothing of vLLM; it relies on what the forward path hands it (`handoff.Step`) and on how vLLM schedules:
  * Each row's place in its prompt is the `positions` the model was called with, so chunked prefill is
    reassembled exactly and a gap (prefix caching skipping cached rows) is detected, not hidden.
  * Rows at positions >= the prompt length (decode) are never stored, except for a request captured while it
    generates: its rows are kept until the driver's `FinishGeneration` says how many make the sample (the driver
    runs it one step past its last token, so that token's row exists).
A prompt too long for the pinned pool (`PinnedPool.fits`) is spilled: its rows go to a file as they come (`spill`).
"""

from __future__ import annotations

import collections
import queue
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle_states.capture import protocol as p
from eagle_states.capture.handoff import CapturedSample, EndedShard, OpenShard, PartialSample, ShardPlan, Step
from eagle_states.capture.protocol import CaptureError
from eagle_states.capture.spill import spill_file

if TYPE_CHECKING:
    from eagle_states.capture.forward import PinnedPool
    from eagle_states.capture.shard_writer import ShardWriter


class Assembler:
    """Samples from steps (views into the steps' states, no copies), handed to the shard writers when complete.

    A shard's plan arrives before its steps (a `BeginShard` marker, which starts its writer), its end after them;
    a failure stops the assembly until the driver's next call reports it (`take_failure`) and `discard` cleans up.
    """

    ENDED_KEPT = 1 << 16  # ended generations remembered (`generation_ended`): far more than ever run at once

    def __init__(self, work: queue.Queue, shards: ShardWriter | None, pinned: PinnedPool):
        self.work = work  # steps and shard markers, in order
        self.shards = shards  # None on ranks that do not write
        self.pinned = pinned
        self.partial: dict[str, PartialSample] = {}  # sample id (generating: request key) -> being assembled
        # generating requests whose sample is decided, so that rows computed after it (a step, at most, before the
        # driver's abort lands) are dropped; the oldest are forgotten past ENDED_KEPT (an engine lives for millions)
        self.generation_ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.complete: dict[str, CapturedSample] = {}  # until its shard's writer takes it
        self.sample_ready = threading.Condition()  # a sample was completed, or writing must stop
        self.captured: dict[str, tuple[int, int]] = {}  # sample id -> (tokens, ids crc), until its shard ends
        self.open_shards: dict[str, OpenShard] = {}  # shard path -> between its markers
        self.spill_to: dict[str, p.BeginShard] = {}  # sample id -> its shard's plan, for samples too long to hold
        self.finished: dict[str, EndedShard] = {}  # shard path -> until the driver's poll reports it
        self.stopping = False  # set by `discard`: writers waiting for samples give up
        self.failure: BaseException | None = None
        self.rows = self.decode_rows_dropped = self.generated_rows = self.spilled_bytes = 0
        self._handlers = {Step: self._assemble, p.BeginShard: self._begin_shard, p.EndShard: self._end_shard,
                          p.FinishGeneration: self._finish_generation}
        self.thread = threading.Thread(target=self._loop, name="eagle-assembler", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            item = self.work.get()
            try:
                if isinstance(item, Step) and item.finish is not None:
                    item = item.finish()  # its encode and copy, here rather than on the forward path
                if self.failure is None:
                    self._handlers[type(item)](item)
            except BaseException as exc:  # reported to the driver on its next call
                self.failure = exc
                with self.sample_ready:  # writers waiting for samples give up
                    self.sample_ready.notify_all()
            finally:
                if isinstance(item, Step) and item.block is not None:
                    self.pinned.release([item.block])
                self.work.task_done()

    def _assemble(self, step: Step):
        if step.copied is not None:
            step.copied.synchronize()
        positions = step.positions.tolist()
        generated = _copy_generating_rows(step, self.generation_ended)
        for r in step.requests:
            sample_id, start, end, prompt_len, generating = r.sample_id, r.start, r.end, r.prompt_len, r.generating
            first = positions[start]
            if generating and sample_id in self.generation_ended or not generating and first >= prompt_len:
                self.decode_rows_dropped += end - start  # decode rows: never stored
                continue
            sample = self.partial.get(sample_id)
            if sample is None:
                if sample_id in self.captured:
                    raise CaptureError(f"sample {sample_id}: two requests in flight carry this sample id")
                if first != 0:
                    raise CaptureError(f"sample {sample_id}: first rows start at position {first}, not 0 "
                                       "(prefix caching skipped cached rows? it must be off)")
                sample = self.partial[sample_id] = PartialSample()
                if sample_id in self.spill_to and step.states is not None and not generating:
                    shard = self.spill_to[sample_id]
                    sample.spill = spill_file(shard.path, prompt_len, shard.codec, shard.spill_dir)
            elif first != sample.next:
                raise CaptureError(f"sample {sample_id}: rows resume at position {first}, expected {sample.next}")
            keep = end if generating else min(end, start + prompt_len - first)  # decode rows are never stored
            self.decode_rows_dropped += end - keep
            if positions[keep - 1] - first != keep - 1 - start:
                raise CaptureError(f"sample {sample_id}: positions of a chunk are not contiguous")
            if generating:
                ids, chunk = generated[sample_id]
                sample.ids.append(ids)
                if chunk is not None:
                    sample.chunks.append(chunk)
            else:
                sample.ids.append(step.input_ids[start:keep].clone())
            if step.states is not None and not generating:
                sample.add_states(step, start, keep, self.pinned)
            sample.next += keep - start
            self.rows += keep - start
            if generating:  # rows of generated tokens (positions past the prompt)
                self.generated_rows += max(0, first + keep - start - max(prompt_len, first))
            if not generating and sample.next == prompt_len:
                del self.partial[sample_id]
                self._complete(sample_id, CapturedSample(torch.cat(sample.ids), sample.chunks, sample.blocks,
                                                         sample.spill))

    def _complete(self, sample_id: str, sample: CapturedSample):
        self.captured[sample_id] = (len(sample.ids), zlib.crc32(sample.ids.numpy().tobytes()))
        if sample.spill is not None:
            self.spilled_bytes += sample.spill.bytes
        with self.sample_ready:
            self.complete[sample_id] = sample
            self.sample_ready.notify_all()

    def _finish_generation(self, call: p.FinishGeneration):
        """A generating request's sample is decided: its first `num_tokens` rows, kept as `sample_id` (or dropped)."""
        key, sample_id, num_tokens = call.key, call.sample_id, call.num_tokens
        sample = self.partial.pop(key, None)
        self.generation_ended[key] = None
        if len(self.generation_ended) > self.ENDED_KEPT:
            self.generation_ended.popitem(last=False)
        if sample is None:
            raise CaptureError(f"generation {key}: finished, but none of its rows were captured")
        if sample_id is None:
            sample.forget(self.pinned)
            return
        if sample.next < num_tokens:
            raise CaptureError(f"generation {key} (sample {sample_id}): {sample.next} rows captured, the sample "
                               f"has {num_tokens} tokens")
        if sample_id in self.captured or sample_id in self.complete:
            raise CaptureError(f"sample {sample_id}: captured twice")
        ids = torch.cat(sample.ids)[:num_tokens]  # rows past the sample's end (one step, at most) go
        # one piece per layer: the writer then writes each state at once, not a row per generated token
        chunks = [[torch.cat(pieces)[:num_tokens] for pieces in zip(*sample.chunks)]] if sample.chunks else []
        self._complete(sample_id, CapturedSample(ids, chunks, sample.blocks))

    def _begin_shard(self, call: p.BeginShard):
        """A shard's plan, queued before its steps: its file is written sample by sample as they are captured,
        so that at a run's end only the last step's samples are left to write."""
        plan = ShardPlan(call.sample_ids, dict(zip(call.sample_ids, call.num_tokens)),
                         dict(zip(call.sample_ids, call.loss_masks)), call.codec)
        if self.shards is not None:
            self.spill_to.update((sid, call) for sid in _to_spill(plan, self.pinned, self.captured))
        future = self.shards.submit(call.path, plan, self.take_complete) if self.shards is not None else None
        self.open_shards[call.path] = OpenShard(plan, future)

    def _end_shard(self, call: p.EndShard):
        shard = self.open_shards[call.path]
        missing = [s for s in shard.plan.sample_ids if s not in self.captured]
        if missing:  # the shard stays open: `discard` waits for its writer before releasing its samples
            raise CaptureError(f"shard {Path(call.path).name}: {len(missing)} samples were not captured completely "
                               f"(first: {missing[:3]}; partial: {sorted(self.partial)[:3]})")
        del self.open_shards[call.path]
        summary = {sid: self.captured.pop(sid) for sid in shard.plan.sample_ids}
        for sid in shard.plan.sample_ids:
            self.spill_to.pop(sid, None)
        if self.shards is None:
            with self.sample_ready:
                for sid in shard.plan.sample_ids:
                    self.complete.pop(sid)
        self.finished[call.path] = EndedShard(summary, shard.future)

    def take_complete(self, sample_id: str) -> CapturedSample:
        """Wait until this sample is complete, and take it (a writer thread)."""
        with self.sample_ready:
            while sample_id not in self.complete:
                if self.stopping or self.failure is not None:
                    raise CaptureError(f"sample {sample_id}: capture stopped before it was complete")
                self.sample_ready.wait()
            return self.complete.pop(sample_id)

    # -- for the driver's calls (on the forward thread) ------------------------------------------------------------
    def take_failure(self) -> BaseException | None:
        failure, self.failure = self.failure, None
        return failure

    def report_ended(self, wait: bool) -> dict[str, p.ShardReport]:
        """Ended shards that are written (the file's hash and size from the writer rank only); `wait`: all of them."""
        done = {}
        for path, shard in list(self.finished.items()):
            if shard.future is None:
                done[path] = p.ShardReport(samples=shard.samples)
            elif wait or shard.future.done():
                digest, size = shard.future.result()  # raises the writer's error
                done[path] = p.ShardReport(samples=shard.samples, digest=digest, bytes=size)
            else:
                continue
            del self.finished[path]
        return done

    def discard(self) -> list[str]:
        """Stop the writers and forget partial and unclaimed samples and unfinished shards; the samples dropped."""
        with self.sample_ready:
            self.stopping = True
            self.sample_ready.notify_all()
        for shard in list(self.open_shards.values()) + list(self.finished.values()):
            if shard.future is not None:
                shard.future.exception()  # wait for writers to stop before their samples are released
        dropped = sorted(self.partial) + sorted(self.complete)
        for sample in (*self.partial.values(), *self.complete.values()):
            sample.forget(self.pinned)
        for table in (self.partial, self.complete, self.captured, self.generation_ended, self.open_shards,
                      self.finished, self.spill_to):
            table.clear()
        self.stopping, self.failure = False, None
        return dropped


def _to_spill(plan: ShardPlan, pinned: PinnedPool, captured: dict) -> list[str]:
    """The samples of a shard whose steps the pinned pool cannot all hold, to be spilled (`spill.spill_file`).
    Samples captured while generating are complete before their shard begins (in `captured`), held as copies."""
    return [sid for sid, n in plan.num_tokens.items() if not pinned.fits(n) and sid not in captured]


def _copy_generating_rows(step: Step, ended: collections.OrderedDict[str, None]) -> dict:
    """The rows of a step's generating requests, copied out of the step in one gather per layer (a decode step has a
    row per request: a copy per request and layer would cost more than the step on a small model): sample id ->
    (token ids, [per layer] or None). Copied because a generating sample lives for hundreds of steps, and views
    would keep every step's pinned block (sized for a whole step) from the pool."""
    spans = [r for r in step.requests if r.generating and r.sample_id not in ended]
    if not spans:
        return {}
    index = torch.tensor([row for r in spans for row in range(r.start, r.end)])
    ids = step.input_ids.index_select(0, index)
    layers = [s.index_select(0, index) for s in step.states] if step.states is not None else None
    out, offset = {}, 0
    for r in spans:
        rows = slice(offset, offset + r.end - r.start)
        out[r.sample_id] = (ids[rows], [layer[rows] for layer in layers] if layers is not None else None)
        offset += r.end - r.start
    return out
