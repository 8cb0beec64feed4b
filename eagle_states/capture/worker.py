"""The capture worker: a vLLM worker extension (`worker_extension_cls`) that captures the residual stream.

What it relies on in vLLM (the versions checked are `CHECKED_VLLM_VERSIONS` in this package's `__init__`):
  * `worker.model_runner.get_model()` holds a module list of decoder layers called as
    `layer(positions, hidden_states, residual, ...)` returning `(hidden_states, residual)` with a fused
    add+RMSNorm, so the stream is `hidden_states + residual` (residual is None entering layer 0). Kernels update
    both in place, so the sum is taken (a new tensor) inside the hook.
  * `model_runner._model_forward(input_ids=..., positions=...)` runs every real scheduler step; warm-up,
    profiling and dummy runs call the model directly, so hooks record only while `_model_forward` runs.
  * Rows of a step belong to requests in `input_batch.req_ids` order, delimited by `query_start_loc.np`;
    rows past the last offset are padding. The order of `scheduler_output.num_scheduled_tokens` is NOT the row
    order. Each row's place in its prompt comes from the `positions` the model was called with, so chunked
    prefill is reassembled exactly and a gap (prefix caching skipping cached rows) is detected, not hidden.
  * A request's sample id travels in `SamplingParams.extra_args[SAMPLE_ID_KEY]`; requests without it are
    ignored, and rows at positions >= the prompt length (decode) are never stored, except for a request flagged
    with `GENERATING_KEY` (captured while it generates): its rows are kept until the driver's `FinishGeneration`
    says how many make the sample (the driver runs it one step past its last token, so that token's row exists).
  * `runner.requests[id].num_computed_tokens` counts the rows computed before this step (host side), so a
    step that holds a prompt's last rows is known when it is launched; `runner.kv_cache_config` gives the KV
    cache's blocks, groups and block size, which the driver needs to admit the next shard early (engine.py).

Data leaves workers as files: one writer rank (tensor-parallel rank 0) assembles samples off the forward path
(an assembler thread) and writes shards with a writer pool; the driver's calls and the replies are the typed
messages of `protocol.py`.
"""

from __future__ import annotations

import collections
import inspect
import queue
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle_states.capture import protocol as p
from eagle_states.capture import CHECKED_VLLM_VERSIONS
from eagle_states.capture.protocol import (GENERATING_KEY, SAMPLE_ID_KEY, CaptureError, UnsupportedModelError,
                                           UnsupportedRunnerError)
from eagle_states.dataset.layout import key_hidden_state, key_input_ids, key_loss_mask, shard_sample_order
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.shard_file import ShardFileWriter, sample_tensor_specs


# ---------------------------------------------------------------------------------------------------------------
# Finding the decoder layers by structure
def _is_decoder_layer(module: torch.nn.Module) -> bool:
    params = inspect.signature(module.forward).parameters
    return "hidden_states" in params and "residual" in params and "positions" in params


def find_decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList whose members are decoder layers taking (positions, hidden_states, residual)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(_is_decoder_layer(m) for m in module):
            return module
    layer_like = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                         for m in m})
    raise UnsupportedModelError(
        f"{type(model).__name__}: no list of decoder layers with a forward(positions, hidden_states, residual) "
        f"signature was found (module lists hold: {layer_like or 'nothing'}); the capture worker supports "
        "vLLM models with fused residual decoder layers (Llama family, DeepSeek-V2/V3, Qwen, Mistral, ...)")


def check_loaded_model(num_layers: int, hidden_size: int | None, setup: p.Setup) -> None:
    """The layer ids were resolved against config.json (and the manifest records it): the loaded model must be the
    one it describes."""
    if (num_layers, hidden_size) != (setup.num_layers, setup.hidden_size):
        raise CaptureError(f"the loaded model has {num_layers} decoder layers of width {hidden_size}, config.json "
                           f"says {setup.num_layers} of width {setup.hidden_size}: the model directory and its "
                           "config disagree")


def _argument_getter(layer: torch.nn.Module, name: str):
    params = list(inspect.signature(layer.forward).parameters)
    position = params.index(name)

    def get(args, kwargs):
        return kwargs[name] if name in kwargs else (args[position] if position < len(args) else None)
    return get


# ---------------------------------------------------------------------------------------------------------------
class _ForwardClock:
    """Forward passes on the device's own timeline: how long each took and how long the device sat idle between
    them (scheduling, sampling, shard boundaries, anything that holds up the engine's loop). On CUDA the model
    call returns once its kernels are queued, so host time would count the GPU's work as the gap; CUDA events
    time it where it runs. The CPU build runs the forward pass synchronously, so host time is that timeline."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pending = collections.deque()  # (start, end) not yet known to have run
        self.previous_end = None  # the gap is counted from here; None after `restart`
        self.forwards, self.forward_s, self.between_s = 0, 0.0, 0.0

    def mark(self):
        if not self.cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start, end):
        self.pending.append((start, end))
        self.settle(wait=False)

    def _seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start  # CUDA events measure in ms

    def settle(self, wait: bool):
        while self.pending:
            start, end = self.pending[0]
            if self.cuda:
                if wait:
                    end.synchronize()
                elif not end.query():
                    return
            self.pending.popleft()
            self.forwards += 1
            self.forward_s += self._seconds(start, end)
            if self.previous_end is not None:
                self.between_s += self._seconds(self.previous_end, start)
            self.previous_end = end

    def restart(self):
        """Counts every pass so far; the next gap is counted from the next pass (idle time before it is not)."""
        self.settle(wait=True)
        self.previous_end = None


class _PinnedBlock:
    """A pinned host buffer holding one step's states; back in the pool once every sample using it is written."""

    __slots__ = ("buffer", "refs")

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.refs = buffer, 0


class _Capture:
    """Per-worker capture state: hooks, step hand-off, sample assembly and shard writing.

    The forward thread only launches the hooks' additions and one asynchronous device-to-host copy per step.
    The assembler thread maps rows to samples (views, no copies). A shard's plan arrives before its steps (a
    begin marker); its writer, in the writer pool, streams each sample from host memory to disk as soon as the
    assembler completes it, in the file's order, and hands its pinned blocks back. Host memory is bounded by the
    pinned pool (CUDA) and by the number of shards being written (`write_threads + 1`).
    """

    PINNED_BUDGET_BYTES = 8 << 30  # pinned host memory for steps in flight (CUDA); at least 4 steps
    ENDED_KEPT = 1 << 16  # ended generations remembered (`generation_ended`): far more than ever run at once

    def __init__(self, worker, setup: p.Setup, writer: bool, rank: int, world_size: int):
        runner = worker.model_runner
        self.runner = runner
        self.layer_ids = setup.layer_ids
        self.writer = writer
        self.rank = rank
        self.world_size = world_size
        model = runner.get_model()
        layers = find_decoder_layers(model)
        self.num_layers = len(layers)
        self.hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        check_loaded_model(self.num_layers, self.hidden_size, setup)
        write_threads = setup.write_threads
        self.active = False
        self.slots: dict[int, torch.Tensor] = {}  # layer id -> stream captured in this step
        self.is_cuda = torch.device(runner.device).type == "cuda"
        self.copy_stream = torch.cuda.Stream() if self.is_cuda else None
        self.work: queue.Queue = queue.Queue()  # steps and shard markers, in order, for the assembler
        self.pinned_free: queue.Queue = queue.Queue()
        self.pinned_allocated = 0
        self.lock = threading.Lock()
        self.partial: dict[str, dict] = {}  # sample id (generating: request key) -> chunks being assembled
        # generating requests whose sample is decided, so that rows computed after it (a step, at most, before the
        # driver's abort lands) are dropped; the oldest are forgotten past ENDED_KEPT (an engine lives for millions)
        self.generation_ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.complete: dict[str, dict] = {}  # sample id -> captured sample, until its shard's writer takes it
        self.sample_ready = threading.Condition()  # the assembler completed a sample, or writing must stop
        self.captured: dict[str, list[int]] = {}  # sample id -> [tokens, ids crc], until its shard's end marker
        self.open_shards: dict[str, dict] = {}  # shard path -> its plan and writer, between its markers
        self.finished: dict[str, dict] = {}  # shard path -> {"samples": summary, "future": write or None}
        self.stopping = False  # set by `discard`: writers waiting for samples give up
        self.launched: list[str] = []  # samples whose last prompt rows were launched, until the driver's next poll
        # pinned_wait_s: the forward thread blocked on back-pressure; last_hand_off: time.monotonic() of the last
        # captured step (so a caller can tell the time spent draining writes after the last forward pass)
        self.stats = {"steps": 0, "rows": 0, "decode_rows_dropped": 0, "generated_rows": 0, "pinned_wait_s": 0.0,
                      "last_hand_off": 0.0, "encoded_bytes": 0, "encode_s": 0.0}
        self.clock = _ForwardClock(self.is_cuda)
        self.pending_copy = None  # CUDA: the last captured step, until `_start_copy` moves it to the host
        self.failure: BaseException | None = None
        self.pool = ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="eagle-writer")
        self.write_slots = threading.BoundedSemaphore(write_threads + 1)
        self.handles = []
        self._hook(layers)
        self._wrap_forward()
        self.assembler = threading.Thread(target=self._assemble_loop, name="eagle-assembler", daemon=True)
        self.assembler.start()

    # -- hooks -----------------------------------------------------------------------------------------------
    def _hook(self, layers):
        for k in sorted(set(self.layer_ids)):
            if k < self.num_layers:
                layer = layers[k]
                get_hidden, get_residual = _argument_getter(layer, "hidden_states"), _argument_getter(layer, "residual")

                def pre_hook(module, args, kwargs, k=k, get_hidden=get_hidden, get_residual=get_residual):
                    if self.active:
                        hidden, residual = get_hidden(args, kwargs), get_residual(args, kwargs)
                        self.slots[k] = hidden.clone() if residual is None else hidden + residual
                self.handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
            else:
                def post_hook(module, args, output, k=k):
                    if self.active:
                        hidden, residual = output
                        self.slots[k] = hidden + residual
                self.handles.append(layers[self.num_layers - 1].register_forward_hook(post_hook))

    def _wrap_forward(self):
        runner = self.runner
        original = runner._model_forward

        def model_forward(*args, **kwargs):
            started = self.clock.mark()  # every real step, captured or not
            try:
                self._start_copy()  # the previous step's states
                requests = self._step_requests()
                if not requests:
                    return original(*args, **kwargs)
                self.slots.clear()
                self.active = self.writer
                try:
                    output = original(*args, **kwargs)
                finally:
                    self.active = False
                self._hand_off(requests, kwargs.get("positions"), kwargs.get("input_ids"))
                return output
            finally:
                self.clock.add(started, self.clock.mark())
        runner._model_forward = model_forward

    def _step_requests(self) -> list[tuple[str, int, int, int, bool]]:
        """(sample id, first row, end row, prompt length, generating) for the captured requests of this step.
        Samples whose last prompt rows are in this step go to `launched` (from the host's counts: reading the
        device's positions here would wait for the GPU); generating ones do not: their sample ends later."""
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        out = []
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = runner.requests[req_id]
            extra = state.sampling_params.extra_args if state.sampling_params else None
            if extra and SAMPLE_ID_KEY in extra:
                prompt_len, generating = len(state.prompt_token_ids), bool(extra.get(GENERATING_KEY))
                out.append((extra[SAMPLE_ID_KEY], starts[i], starts[i + 1], prompt_len, generating))
                if not generating and state.num_computed_tokens + starts[i + 1] - starts[i] >= prompt_len:
                    self.launched.append(extra[SAMPLE_ID_KEY])
        return out

    def _hand_off(self, requests, positions, input_ids):
        """Queue this step's rows for the assembler (on CUDA: stacked on the device, for `_start_copy`)."""
        if positions is None or input_ids is None or positions.dim() != 1:
            raise CaptureError("the capture worker needs 1-D positions and token ids (no M-RoPE, no prompt embeds)")
        num_rows = max(request[2] for request in requests)
        # positions and token ids live in persistent buffers that the next step overwrites: copy them now
        positions, input_ids = positions[:num_rows].clone(), input_ids[:num_rows].clone()
        states = None
        if self.writer:
            missing = [k for k in self.layer_ids if k not in self.slots]
            if missing:
                raise CaptureError(f"layers {missing} were not reached in this forward pass")
            states = [self.slots[k][:num_rows] for k in self.layer_ids]
            if any(s.shape[0] < num_rows for s in states):
                raise CaptureError(f"captured {[tuple(s.shape) for s in states]} for {num_rows} rows "
                                   "(sequence-parallel layers are not supported)")
        self.slots.clear()
        self.stats["steps"] += 1
        self.stats["last_hand_off"] = time.monotonic()
        if not self.is_cuda:
            self.work.put(("step", None, requests, positions, input_ids, states, None))
            return
        stacked = torch.stack(states) if states else None  # one copy to the host instead of L
        computed = torch.cuda.Event()
        computed.record()
        self.pending_copy = (computed, requests, positions, input_ids, stacked)

    def _start_copy(self):
        """Launch the device-to-host copy of the last captured step, on its own stream.

        Deferred from the step itself to the next forward pass or driver call: launched at once, a step's states
        (512 MB for 16k tokens of Llama-8B) would hold the device-to-host copy engine just when vLLM copies the
        step's sampled tokens to the host, and vLLM, waiting for those, could wait for ours while the GPU idles.
        Deferred, the copy runs beside the next forward pass (measured effect small: bench/RESULTS.md, run 6)."""
        if self.pending_copy is None:
            return
        computed, requests, positions, input_ids, stacked = self.pending_copy
        self.pending_copy = None
        block = None
        self.copy_stream.wait_event(computed)
        with torch.cuda.stream(self.copy_stream):
            for t in (positions, input_ids, stacked):
                if t is not None:
                    t.record_stream(self.copy_stream)  # no reuse by the allocator before the copy ends
            positions, input_ids = positions.to("cpu", non_blocking=True), input_ids.to("cpu", non_blocking=True)
            states = None
            if stacked is not None:
                block = self._take_pinned(stacked)
                host = block.buffer[: stacked.numel()].view(stacked.shape).copy_(stacked, non_blocking=True)
                states = list(host.unbind(0))
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.work.put(("step", copied, requests, positions, input_ids, states, block))

    def _take_pinned(self, like: torch.Tensor) -> _PinnedBlock:
        """A pinned block from the pool (pinning memory per step is slow); when all are in use, waits for the
        writer to release one, which is the back-pressure that bounds host memory."""
        try:
            block = self.pinned_free.get_nowait()
        except queue.Empty:
            capacity = like[0].numel() * len(self.layer_ids) * self.runner.max_num_tokens // like.shape[1]
            limit = max(4, self.PINNED_BUDGET_BYTES // (capacity * like.element_size()))
            if self.pinned_allocated < limit:
                self.pinned_allocated += 1
                # a normal tensor even when taken in the forward pass (inference mode): a driver call (outside
                # it) may copy the next step into it, which an inference tensor refuses
                with torch.inference_mode(False):
                    buffer = torch.empty(max(capacity, like.numel()), dtype=like.dtype, pin_memory=True)
                block = _PinnedBlock(buffer)
            else:
                waited = time.monotonic()
                block = self.pinned_free.get()
                self.stats["pinned_wait_s"] += time.monotonic() - waited
        block.refs = 1  # the step's own reference, dropped when the assembler is done with it
        return block

    def _release(self, blocks):
        with self.lock:
            for block in blocks:
                block.refs -= 1
                if block.refs == 0:
                    self.pinned_free.put(block)

    # -- assembly (off the forward path) ------------------------------------------------------------------------
    def _assemble_loop(self):
        handlers = {"step": self._assemble, "begin": self._begin_shard, "end": self._end_shard,
                    "finish": self._finish_generation}
        while True:
            item = self.work.get()
            try:
                if item is None:
                    return
                if self.failure is None:
                    handlers[item[0]](*item[1:])
            except BaseException as exc:  # reported to the driver on its next call
                self.failure = exc
                with self.sample_ready:  # writers waiting for samples give up
                    self.sample_ready.notify_all()
            finally:
                if item is not None and item[0] == "step" and item[-1] is not None:
                    self._release([item[-1]])
                self.work.task_done()

    def _assemble(self, event, requests, positions, input_ids, states, block):
        if event is not None:
            event.synchronize()
        positions = positions.tolist()
        generated = self._copy_generating_rows(requests, input_ids, states)
        for sample_id, start, end, prompt_len, generating in requests:
            first = positions[start]
            if generating and sample_id in self.generation_ended or not generating and first >= prompt_len:
                self.stats["decode_rows_dropped"] += end - start  # decode rows: never stored
                continue
            sample = self.partial.get(sample_id)
            if sample is None:
                if sample_id in self.captured:
                    raise CaptureError(f"sample {sample_id}: two requests in flight carry this sample id")
                if first != 0:
                    raise CaptureError(f"sample {sample_id}: first rows start at position {first}, not 0 "
                                       "(prefix caching skipped cached rows? it must be off)")
                sample = self.partial[sample_id] = {"next": 0, "ids": [], "chunks": [], "blocks": []}
            elif first != sample["next"]:
                raise CaptureError(f"sample {sample_id}: rows resume at position {first}, expected {sample['next']}")
            keep = end if generating else min(end, start + prompt_len - first)  # decode rows are never stored
            self.stats["decode_rows_dropped"] += end - keep
            if positions[keep - 1] - first != keep - 1 - start:
                raise CaptureError(f"sample {sample_id}: positions of a chunk are not contiguous")
            if generating:
                ids, chunk = generated[sample_id]
                sample["ids"].append(ids)
                if chunk is not None:
                    sample["chunks"].append(chunk)
            else:
                sample["ids"].append(input_ids[start:keep].clone())
            if states is not None and not generating:
                sample["chunks"].append([s[start:keep] for s in states])  # views: no copy
                if block is not None:
                    with self.lock:
                        block.refs += 1
                    sample["blocks"].append(block)
            sample["next"] += keep - start
            self.stats["rows"] += keep - start
            if generating:  # rows of generated tokens (positions past the prompt)
                self.stats["generated_rows"] += max(0, first + keep - start - max(prompt_len, first))
            if not generating and sample["next"] == prompt_len:
                del self.partial[sample_id]
                sample["ids"] = torch.cat(sample["ids"])
                self.captured[sample_id] = [len(sample["ids"]), zlib.crc32(sample["ids"].numpy().tobytes())]
                with self.sample_ready:
                    self.complete[sample_id] = sample
                    self.sample_ready.notify_all()

    def _copy_generating_rows(self, requests, input_ids, states) -> dict:
        """The rows of this step's generating requests, copied out of the step in one gather per layer (a decode
        step has a row per request: a copy per request and layer would cost more than the step on a small model):
        sample id -> (token ids, [per layer] or None). Copied because a generating sample lives for hundreds of
        steps, and views would keep every step's pinned block (sized for a whole step) from the pool."""
        spans = [(sid, start, end) for sid, start, end, _, generating in requests
                 if generating and sid not in self.generation_ended]
        if not spans:
            return {}
        index = torch.tensor([row for _, start, end in spans for row in range(start, end)])
        ids = input_ids.index_select(0, index)
        layers = [s.index_select(0, index) for s in states] if states is not None else None
        out, offset = {}, 0
        for sid, start, end in spans:
            rows = slice(offset, offset + end - start)
            out[sid] = (ids[rows], [layer[rows] for layer in layers] if layers is not None else None)
            offset += end - start
        return out

    def _finish_generation(self, key: str, sample_id: str | None, num_tokens: int):
        """A generating request's sample is decided: its first `num_tokens` rows, kept as `sample_id` (or dropped)."""
        sample = self.partial.pop(key, None)
        self.generation_ended[key] = None
        if len(self.generation_ended) > self.ENDED_KEPT:
            self.generation_ended.popitem(last=False)
        if sample is None:
            raise CaptureError(f"generation {key}: finished, but none of its rows were captured")
        if sample_id is None:
            self._forget(sample)
            return
        if sample["next"] < num_tokens:
            raise CaptureError(f"generation {key} (sample {sample_id}): {sample['next']} rows captured, the sample "
                               f"has {num_tokens} tokens")
        if sample_id in self.captured or sample_id in self.complete:
            raise CaptureError(f"sample {sample_id}: captured twice")
        ids = torch.cat(sample["ids"])[:num_tokens]  # rows past the sample's end (one step, at most) go
        # one piece per layer: the writer then writes each state at once, not a row per generated token
        chunks = [[torch.cat(pieces)[:num_tokens] for pieces in zip(*sample["chunks"])]] if sample["chunks"] else []
        sample.update(ids=ids, chunks=chunks)
        self.captured[sample_id] = [len(ids), zlib.crc32(ids.numpy().tobytes())]
        with self.sample_ready:
            self.complete[sample_id] = sample
            self.sample_ready.notify_all()

    def _begin_shard(self, path: str, sample_ids: list[str], num_tokens: list[int], loss_masks: list[list[int]],
                     codec: Codec):
        """A shard's plan, queued before its steps: its file is written sample by sample as they are captured,
        so that at a run's end only the last step's samples are left to write."""
        shard = {"samples": sample_ids, "num_tokens": dict(zip(sample_ids, num_tokens)),
                 "loss_masks": dict(zip(sample_ids, loss_masks)), "codec": codec, "future": None}
        if self.writer:
            self.write_slots.acquire()  # at most write_threads + 1 shards held for writing
            shard["future"] = self.pool.submit(self._write_shard, path, shard)
        self.open_shards[path] = shard

    def _end_shard(self, path: str):
        shard = self.open_shards.pop(path)
        missing = [s for s in shard["samples"] if s not in self.captured]
        if missing:
            raise CaptureError(f"shard {Path(path).name}: {len(missing)} samples were not captured completely "
                               f"(first: {missing[:3]}; partial: {sorted(self.partial)[:3]})")
        summary = {sid: self.captured.pop(sid) for sid in shard["samples"]}
        if not self.writer:
            with self.sample_ready:
                for sid in shard["samples"]:
                    self.complete.pop(sid)
        self.finished[path] = {"samples": summary, "future": shard["future"]}

    def _take_complete(self, sample_id: str) -> dict:
        """Wait until the assembler has captured this sample, and take it (a writer thread)."""
        with self.sample_ready:
            while sample_id not in self.complete:
                if self.stopping or self.failure is not None:
                    raise CaptureError(f"sample {sample_id}: capture stopped before it was complete")
                self.sample_ready.wait()
            return self.complete.pop(sample_id)

    def _write_shard(self, path: str, shard: dict) -> tuple[str, int]:
        try:
            order = shard_sample_order(shard["samples"])
            first = self._take_complete(order[0])
            try:
                like = first["chunks"][0][0]  # the stream's dtype and width, from the first captured piece
                specs = {}
                for sid in order:
                    specs.update(sample_tensor_specs(sid, shard["num_tokens"][sid], len(self.layer_ids),
                                                              like.shape[-1], like.dtype))
                with ShardFileWriter(Path(path), specs, shard["codec"]) as out:
                    for sid in order:
                        sample = first if sid == order[0] else self._take_complete(sid)
                        try:
                            self._write_sample(out, sid, sample, shard["loss_masks"][sid])
                        finally:
                            self._forget(sample)
                with self.lock:
                    self.stats["encoded_bytes"] += out.encoded_bytes
                    self.stats["encode_s"] += out.encode_s
            finally:
                self._forget(first)  # a no-op once written; gives it back when the file could not be opened
            return out.sha256, out.size
        except OSError as exc:
            if exc.filename is None:  # "No space left on device" names no file; the user needs to know which disk
                raise OSError(exc.errno, exc.strerror, path) from exc
            raise
        finally:
            self.write_slots.release()

    def _write_sample(self, out: ShardFileWriter, sample_id: str, sample: dict, mask: list[int]):
        if len(mask) != len(sample["ids"]):
            raise CaptureError(f"sample {sample_id}: loss mask of {len(mask)} for {len(sample['ids'])} tokens")
        tensors = {key_input_ids(sample_id): [sample["ids"].to(torch.int32)],
                   key_loss_mask(sample_id): [torch.tensor(mask, dtype=torch.uint8)]}
        for slot in range(len(self.layer_ids)):
            tensors[key_hidden_state(sample_id, slot)] = [chunk[slot] for chunk in sample["chunks"]]
        for name in sorted(tensors):
            out.write(name, tensors[name])

    def _forget(self, sample: dict) -> None:
        """Hand a written (or abandoned) sample's pinned blocks back, once."""
        if sample["chunks"] is not None:
            sample["chunks"] = None
            self._release(sample["blocks"])

    # -- driver calls ----------------------------------------------------------------------------------------------
    def _raise_failure(self):
        if self.failure is not None:
            failure, self.failure = self.failure, None
            if isinstance(failure, OSError):  # keeps its errno: a full disk is not retried
                raise OSError(failure.errno, f"capture failed on rank {self.rank}: {failure.strerror}",
                              failure.filename) from failure
            raise CaptureError(f"capture failed on rank {self.rank}: {failure}") from failure

    def begin_shard(self, call: p.BeginShard) -> p.Queued:
        """Queue a shard's plan before its requests run; returns at once."""
        self._raise_failure()
        self._start_copy()
        self.work.put(("begin", call.path, call.sample_ids, call.num_tokens, call.loss_masks, call.codec))
        return p.Queued(path=call.path)

    def end_shard(self, call: p.EndShard) -> p.Queued:
        """Queue the end of a shard behind the steps already captured; returns at once."""
        self._raise_failure()
        self._start_copy()  # its last step
        self.work.put(("end", call.path))
        return p.Queued(path=call.path)

    def finish_generation(self, call: p.FinishGeneration) -> p.GenerationQueued:
        """Queue a generating request's end behind the steps already captured (its last row's step); returns at
        once."""
        self._raise_failure()
        self._start_copy()
        self.work.put(("finish", call.key, call.sample_id, call.num_tokens))
        return p.GenerationQueued(key=call.key)

    def poll(self, call: p.Poll) -> p.PollReply:
        """Shards that are done (the file's hash and size from the writer rank only), and the samples whose last
        rows were launched since the last poll. `wait` blocks until every ended shard is done."""
        self._start_copy()
        if call.wait:
            self.work.join()
        self._raise_failure()
        done = {}
        for path, entry in list(self.finished.items()):
            future = entry["future"]
            if future is None:
                done[path] = p.ShardReport(samples=entry["samples"])
            elif call.wait or future.done():
                sha, size = future.result()  # raises the writer's error
                done[path] = p.ShardReport(samples=entry["samples"], sha256=sha, bytes=size)
            else:
                continue
            del self.finished[path]
        launched, self.launched = self.launched, []
        return p.PollReply(shards=done, launched=launched)

    def stats_reply(self, call: p.Stats) -> p.StatsReply:
        """The counters, with the forward passes so far (device time in them and idle between them); the next
        gap is counted from the next pass on (a caller reads the stats before and after what it measures, and the
        idle time before it is not counted)."""
        self.clock.restart()
        return p.StatsReply(**self.stats, forwards=self.clock.forwards, forward_s=self.clock.forward_s,
                            between_forwards_s=self.clock.between_s)

    def discard(self, call: p.Discard) -> p.Discarded:
        """Forget partial and unclaimed samples and unfinished shards (after a failure) so that a retry starts
        clean; their temp files are removed."""
        self._start_copy()
        self.work.join()
        with self.sample_ready:
            self.stopping = True
            self.sample_ready.notify_all()
        for entry in list(self.open_shards.values()) + list(self.finished.values()):
            if entry["future"] is not None:
                entry["future"].exception()  # wait for writers to stop before their samples are released
        dropped = sorted(self.partial) + sorted(self.complete)
        for sample in list(self.partial.values()) + list(self.complete.values()):
            self._forget(sample)
        self.partial.clear()
        self.complete.clear()
        self.captured.clear()
        self.launched.clear()
        self.generation_ended.clear()
        self.open_shards.clear()
        self.finished.clear()
        self.stopping, self.failure = False, None
        return p.Discarded(samples=dropped)


def check_model_runner(runner_class: type) -> None:
    """The capture hooks need vLLM's V1 model runner (`vllm.v1.worker.gpu_model_runner.GPUModelRunner`, or a
    subclass such as the CPU build's): its `_model_forward`, `input_batch` and `requests` are what they read. vLLM's
    V2 runner (`vllm.v1.worker.gpu.model_runner`, the GPU default from vLLM 0.33) has another forward path; a vLLM
    without the V1 runner cannot be captured at all. Refused here, at engine start, with what to do."""
    import vllm

    checked = ", ".join(CHECKED_VLLM_VERSIONS)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner
    except ImportError:
        raise UnsupportedRunnerError(f"vLLM {vllm.__version__} has no V1 model runner, which the capture hooks need; "
                                     f"install a version it was checked on ({checked})") from None
    if not (isinstance(runner_class, type) and issubclass(runner_class, V1Runner)):
        name = f"{getattr(runner_class, '__module__', '?')}.{getattr(runner_class, '__qualname__', runner_class)}"
        raise UnsupportedRunnerError(
            f"vLLM {vllm.__version__} runs the model runner {name}; the capture hooks need the V1 runner "
            f"(vllm.v1.worker.gpu_model_runner.GPUModelRunner): set VLLM_USE_V2_MODEL_RUNNER=0 (the capture sets it "
            f"unless it is set already), or install a version it was checked on ({checked})")


class CaptureWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`). The driver calls `eagle_capture_call` with a message of
    `protocol.py` through `collective_rpc`; every rank answers with an `Envelope`."""

    def eagle_capture_call(self, call: p.Message) -> p.Envelope:
        if type(call) not in p.REPLY:
            raise CaptureError(f"the capture worker does not take {type(call).__name__}")
        if isinstance(call, p.Setup):
            return self._eagle_setup(call)
        cap: _Capture = getattr(self, "_eagle_capture", None)
        if cap is None:
            raise CaptureError(f"{type(call).__name__} before Setup")
        handler = {p.BeginShard: cap.begin_shard, p.EndShard: cap.end_shard,
                   p.FinishGeneration: cap.finish_generation, p.Poll: cap.poll, p.Stats: cap.stats_reply,
                   p.Discard: cap.discard}[type(call)]
        return self._eagle_envelope(handler(call))

    def _eagle_envelope(self, payload: p.Message) -> p.Envelope:
        cap: _Capture = self._eagle_capture
        return p.Envelope(rank=cap.rank, world_size=cap.world_size, writer=cap.writer, payload=payload)

    def _eagle_setup(self, call: p.Setup) -> p.Envelope:
        import vllm
        from vllm.distributed import parallel_state

        if getattr(self, "_eagle_capture", None) is not None:
            raise CaptureError("capture is already set up on this worker")
        check_model_runner(type(self.model_runner))  # before a hook is installed
        pp_size = self.vllm_config.parallel_config.pipeline_parallel_size
        if pp_size > 1:
            raise UnsupportedModelError("pipeline parallelism is not supported: use tensor parallelism")
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self._eagle_capture = cap = _Capture(self, call, writer=(tp_rank == 0), rank=tp_rank, world_size=world_size)
        kv = self.model_runner.kv_cache_config  # what the scheduler admits requests against
        return self._eagle_envelope(p.SetupReply(
            num_layers=cap.num_layers, hidden_size=cap.hidden_size, device=str(self.model_runner.device),
            vllm_version=vllm.__version__, model_runner=f"{type(self.model_runner).__module__}."
            f"{type(self.model_runner).__qualname__}", kv_cache_blocks=kv.num_blocks, kv_cache_groups=len(kv.kv_cache_groups),
            kv_block_tokens=min(g.kv_cache_spec.block_size for g in kv.kv_cache_groups)))
