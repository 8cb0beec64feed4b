"""The forward path: hooks that capture the residual stream, and each step's hand-off to the assembler.

The one part of the capture that reads vLLM's model runner (a second runner, vLLM's V2, needs a second version of
this module and nothing else). What it relies on (the versions checked are `CHECKED_VLLM_VERSIONS`):
  * `runner.get_model()` holds a module list of decoder layers called as
    `layer(positions, hidden_states, residual, ...)` returning `(hidden_states, residual)` with a fused
    add+RMSNorm, so the stream is `hidden_states + residual` (residual is None entering layer 0). Kernels update
    both in place, so the sum is taken (a new tensor) inside the hook.
  * `runner._model_forward(input_ids=..., positions=...)` runs every real scheduler step; warm-up, profiling and
    dummy runs call the model directly, so hooks record only while `_model_forward` runs. `positions` and
    `input_ids` are persistent buffers that the next step overwrites.
  * Rows of a step belong to requests in `runner.input_batch.req_ids` order, delimited by
    `runner.query_start_loc.np`; rows past the last offset are padding. The order of
    `scheduler_output.num_scheduled_tokens` is NOT the row order.
  * A request's sample id travels in `SamplingParams.extra_args[SAMPLE_ID_KEY]` (`runner.requests[id]
    .sampling_params`); requests without it are ignored. `GENERATING_KEY` there flags a request captured while
    it generates.
  * `runner.requests[id].num_computed_tokens` counts the rows computed before this step (host side), so a
    step that holds a prompt's last rows is known when it is launched; `runner.max_num_tokens` bounds a step's
    rows; `runner.kv_cache_config` gives the KV cache's blocks, groups and block size, which the driver needs to
    admit the next shard early (engine.py).
"""

from __future__ import annotations

import collections
import inspect
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from eagle_states.capture import CHECKED_VLLM_VERSIONS
from eagle_states.capture import protocol as p
from eagle_states.capture.handoff import PinnedBlock, Step, StepRequest, fits_host_buffer, pinned_blocks
from eagle_states.capture.protocol import (GENERATING_KEY, SAMPLE_ID_KEY, CaptureError, UnsupportedModelError,
                                           UnsupportedRunnerError)
from eagle_states.dataset.codec import NVCOMP_CODECS, Codec
from eagle_states.dataset.step_codecs import (EncodedStep, NvcompStepEncoder, fp8_ans_encode_step, fp8_encode_step,
                                              fp8_rows)


# ---------------------------------------------------------------------------------------------------------------
# The model runner and the decoder layers, by structure
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


def kv_cache_facts(runner) -> dict[str, int]:
    """The KV cache the scheduler admits requests against, as `SetupReply` fields."""
    kv = runner.kv_cache_config
    return {"kv_cache_blocks": kv.num_blocks, "kv_cache_groups": len(kv.kv_cache_groups),
            "kv_block_tokens": min(g.kv_cache_spec.block_size for g in kv.kv_cache_groups)}


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


class PinnedPool:
    """Pinned host blocks for steps in flight (CUDA), reused: pinning memory per step is slow. Taken by the forward
    thread (by the assembler for nvCOMP codecs' steps), given back by the assembler and the writers."""

    def __init__(self, num_states: int, max_num_tokens: int, budget_bytes: int, row_bytes: int):
        self.num_states, self.max_num_tokens, self.budget_bytes = num_states, max_num_tokens, budget_bytes
        self.row_bytes = row_bytes  # a captured row's states, every layer: what `fits` sizes samples by
        self.free: queue.Queue[PinnedBlock] = queue.Queue()
        self.allocated = 0
        self.lock = threading.Lock()
        self.wait_s = 0.0  # the forward thread blocked on back-pressure
        self.held_bytes = 0  # steps' bytes in blocks in use: copied, not yet written (or framed) by a writer

    def reserve(self, row_bytes: int) -> None:
        """Pin every block of the budget now, for steps of `row_bytes` rows: at engine start rather than inside the
        first run's forward passes (pinning a block of a GiB takes a fraction of a second, which the device
        otherwise idles through, once per engine)."""
        capacity, limit = pinned_blocks(self.budget_bytes, row_bytes, self.max_num_tokens)
        with torch.inference_mode(False):
            while self.allocated < limit:
                self.free.put(PinnedBlock(torch.empty(capacity, dtype=torch.uint8, pin_memory=True)))
                self.allocated += 1

    def fits(self, num_tokens: int) -> bool:
        """Whether a sample of `num_tokens` prompt rows is held here until complete (else it is spilled)."""
        return fits_host_buffer(num_tokens, self.budget_bytes, self.row_bytes, self.max_num_tokens)

    def take(self, stacked: torch.Tensor, nbytes: int) -> PinnedBlock:
        """A block (bytes) for a step of `stacked`'s width and dtype, holding `nbytes` (the step as copied: its
        states, or what a step codec made of them); when all are in use, waits for the writer to release one,
        which is the back-pressure that bounds host memory."""
        try:
            block = self.free.get_nowait()
        except queue.Empty:
            row_bytes = stacked[0, 0].numel() * stacked.element_size() * self.num_states
            capacity, limit = pinned_blocks(self.budget_bytes, row_bytes, self.max_num_tokens)
            with self.lock:  # two threads may take blocks
                allocate = self.allocated < limit
                self.allocated += allocate
            if allocate:
                # a normal tensor even when taken in the forward pass (inference mode): a driver call (outside
                # it) may copy the next step into it, which an inference tensor refuses
                with torch.inference_mode(False):
                    buffer = torch.empty(max(capacity, nbytes), dtype=torch.uint8, pin_memory=True)
                block = PinnedBlock(buffer)
            else:
                waited = time.monotonic()
                block = self.free.get()
                self.wait_s += time.monotonic() - waited
        if block.buffer.numel() < nbytes:  # a step codec's output past the slack: this block grows, once
            with torch.inference_mode(False):
                block.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        block.refs, block.nbytes = 1, nbytes  # the step's own reference, dropped when the assembler is done with it
        with self.lock:
            self.held_bytes += nbytes
        return block

    def hold(self, block: PinnedBlock) -> None:
        """One more sample uses the block."""
        with self.lock:
            block.refs += 1

    def release(self, blocks: list[PinnedBlock]) -> None:
        with self.lock:
            for block in blocks:
                block.refs -= 1
                if block.refs == 0:
                    self.held_bytes -= block.nbytes
                    self.free.put(block)


class StepEncoding:
    """The step codecs (`extract.codec` fp8-e4m3, nvcomp-ans, fp8-e4m3-ans) where a step's states are, before the
    copy, timed on the device's timeline. The nvCOMP codecs run on their own stream from the assembler thread
    (nvCOMP's host API waits for its output sizes): at most DEVICE_STEPS steps wait for it on the device, then the
    forward pass waits."""

    DEVICE_STEPS = 3

    def __init__(self, clock: _ForwardClock, is_cuda: bool):
        self.clock, self.is_cuda = clock, is_cuda
        self.stream = torch.cuda.Stream() if is_cuda else None
        self.device_steps = threading.BoundedSemaphore(self.DEVICE_STEPS)
        self.nvcomp: NvcompStepEncoder | None = None  # made on the first nvCOMP step, in the thread using it
        self.timing: list = []  # (start, end, bytes) of encodes not yet counted
        self.lock = threading.Lock()  # encodes run on the forward and the assembler threads
        self.encoded_bytes, self.encode_s = 0, 0.0

    def encode(self, stacked: torch.Tensor, spans: list[tuple[int, int]], codec: Codec,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> EncodedStep:
        """`stacked` encoded where it is (on CUDA: queued on the caller's stream, behind the step's kernels);
        fp8-e4m3-ans: from its fp8 codes and row numbers (`quantize`, made in the forward thread)."""
        start = self.clock.mark()
        if codec.name == "fp8-e4m3":
            encoded = fp8_encode_step(stacked)
        else:
            self.nvcomp = self.nvcomp or NvcompStepEncoder(self.stream)
            encoded = (self.nvcomp(stacked, spans) if codec.name == "nvcomp-ans" else
                       fp8_ans_encode_step(stacked, spans, self.nvcomp, quantized))
        self._timed(start, 0 if quantized is not None else stacked.numel() * stacked.element_size())
        return encoded

    def quantize(self, stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8-e4m3-ans's fp8 step, queued on the caller's stream. Called in the forward thread, as fp8-e4m3's
        whole encode is: the compiled step's first call traces it, and Dynamo's tracing flag is global, so traced
        in the assembler thread it made vLLM's own compiled functions, called by the forward pass meanwhile, fail
        (DeepSeek-V3's MoE routing on the H200: "FX to symbolically trace a dynamo-optimized function")."""
        start = self.clock.mark()
        quantized = fp8_rows(stacked)
        self._timed(start, stacked.numel() * stacked.element_size())
        return quantized

    def _timed(self, start, nbytes: int) -> None:
        with self.lock:
            self.timing.append((start, self.clock.mark(), nbytes))

    def seconds(self) -> tuple[int, float]:
        """(bytes, seconds) the step codecs took in so far (waits for the encodes still running)."""
        with self.lock:
            timing, self.timing = self.timing, []
        for start, end, nbytes in timing:
            if self.is_cuda:
                end.synchronize()
            self.encoded_bytes += nbytes
            self.encode_s += start.elapsed_time(end) / 1e3 if self.is_cuda else end - start
        return self.encoded_bytes, self.encode_s


@dataclass(frozen=True, slots=True, eq=False)
class _DeviceStep:
    """A captured step on the device (CUDA), until `HostCopies.start` moves it to the host."""
    computed: torch.cuda.Event  # its states are computed once the compute stream passes this
    requests: list[StepRequest]
    positions: torch.Tensor
    input_ids: torch.Tensor
    stacked: torch.Tensor | None  # (layers, rows, hidden): one copy to the host instead of one per layer
    codec: Codec  # its shard's: a step codec encodes it before the copy
    spans: list[tuple[int, int]]  # the row spans samples take from it (what nvCOMP encodes apart)


class ForwardCapture:
    """Hooks on the decoder layers and `_model_forward`: per captured step the forward thread launches the hooks'
    additions and hands the step (rows, token ids, positions, states) to `deliver`; on CUDA through `HostCopies`
    (one asynchronous device-to-host copy into a pinned block), launched by `start_copy`."""

    def __init__(self, runner, setup: p.Setup, writer: bool, deliver: Callable[[Step], None]):
        self.runner = runner
        self.layer_ids = setup.layer_ids
        self.writer = writer  # only the writer rank captures states; the others hand off positions and ids
        self.deliver = deliver
        model = runner.get_model()
        layers = find_decoder_layers(model)
        self.num_layers = len(layers)
        self.hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        check_loaded_model(self.num_layers, self.hidden_size, setup)
        self.active = False
        self.slots: dict[int, torch.Tensor] = {}  # layer id -> stream captured in this step
        self.is_cuda = torch.device(runner.device).type == "cuda"
        dtype = getattr(runner, "dtype", None)  # the states' (the model's activations')
        if not isinstance(dtype, torch.dtype):
            dtype = runner.model_config.dtype
        row_bytes = setup.hidden_size * dtype.itemsize * len(self.layer_ids)
        self.pinned = PinnedPool(len(self.layer_ids), runner.max_num_tokens, setup.host_buffer_bytes, row_bytes)
        if self.is_cuda and writer:
            self.pinned.reserve(row_bytes)
        # the codec of the shard whose steps come next (`BeginShard`; a step holds rows of one shard only)
        self.codec = Codec()
        self.launched: list[str] = []  # samples whose last prompt rows were launched, until the driver's next poll
        self.steps = 0
        # the last captured step's end (`last_forward_end`): its CUDA event (timed), or time.monotonic() on the CPU
        self.last_computed: torch.cuda.Event | float | None = None
        self.backlog_bytes = 0  # host-buffer bytes of earlier steps not yet written, then
        self.clock = _ForwardClock(self.is_cuda)
        self.encoding = StepEncoding(self.clock, self.is_cuda)
        self.copies = HostCopies(self.pinned, self.encoding, deliver) if self.is_cuda else None
        self.handles = []
        self._hook(layers)
        self._wrap_forward()

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
                self.start_copy()  # the previous step's states
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

    def _step_requests(self) -> list[StepRequest]:
        """The captured requests of this step. Samples whose last prompt rows are in this step go to `launched`
        (from the host's counts: reading the device's positions here would wait for the GPU); generating ones do
        not: their sample ends later."""
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
                out.append(StepRequest(extra[SAMPLE_ID_KEY], starts[i], starts[i + 1], prompt_len, generating,
                                       state.num_computed_tokens))
                if not generating and state.num_computed_tokens + starts[i + 1] - starts[i] >= prompt_len:
                    self.launched.append(extra[SAMPLE_ID_KEY])
        return out

    def _hand_off(self, requests: list[StepRequest], positions, input_ids):
        """Hand this step's rows to the assembler (on CUDA: stacked on the device, for `HostCopies.start`)."""
        if positions is None or input_ids is None or positions.dim() != 1:
            raise CaptureError("the capture worker needs 1-D positions and token ids (no M-RoPE, no prompt embeds)")
        num_rows = max(request.end for request in requests)
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
        self.steps += 1
        self.backlog_bytes = self.pinned.held_bytes
        spans = [r.prompt_rows for r in requests if not r.generating and r.prompt_rows[1] > r.prompt_rows[0]]
        if not self.is_cuda:  # the states are host tensors already
            self.last_computed = time.monotonic()
            if states and self.codec.on_device:
                if self.codec.name != "fp8-e4m3":
                    raise CaptureError(f"extract.codec {self.codec.name} encodes on a CUDA device; this engine "
                                       f"runs on {self.runner.device}")
                encoded = self.encoding.encode(torch.stack(states), spans, self.codec)
                states = encoded.host_rows(encoded.data, self.codec.name)
            self.deliver(Step(requests, positions, input_ids, states, block=None, copied=None))
            return
        stacked = torch.stack(states) if states else None  # one copy to the host instead of one per layer
        computed = self.last_computed = torch.cuda.Event(enable_timing=True)
        computed.record()
        self.copies.pending = _DeviceStep(computed, requests, positions, input_ids, stacked, self.codec, spans)

    def last_forward_end(self) -> float:
        """time.monotonic() when the last captured step's forward pass ended (0.0 before any). On CUDA the host
        hands a step over when it has launched it, up to a step or two before the device is done with it: the
        end is read on the device's timeline, against an event recorded now."""
        last = self.last_computed
        if not isinstance(last, torch.cuda.Event):
            return last or 0.0
        now = torch.cuda.Event(enable_timing=True)
        now.record()
        now.synchronize()
        last.synchronize()
        return time.monotonic() - last.elapsed_time(now) / 1e3

    def start_copy(self):
        """Launch the last captured step's copy to the host (CUDA; `HostCopies.start`)."""
        if self.copies is not None:
            self.copies.start()


class HostCopies:
    """Captured steps moved to the host (CUDA): each step's states, or what a step codec made of them, copied on a
    stream of its own into a pinned block (`_to_host`), then handed to `deliver` for the assembler. nvCOMP codecs'
    steps are encoded and copied in the assembler's thread (`_finish_nvcomp`)."""

    def __init__(self, pinned: PinnedPool, encoding: StepEncoding, deliver: Callable[[Step], None]):
        self.pinned, self.encoding, self.deliver = pinned, encoding, deliver
        self.stream = torch.cuda.Stream()
        self.pending: _DeviceStep | None = None  # the last captured step, until `start` launches its copy

    def start(self):
        """Launch the device-to-host copy of the last captured step, on its own stream.

        Deferred from the step itself to the next forward pass or driver call: launched at once, a step's states
        (512 MB for 16k tokens of Llama-8B) would hold the device-to-host copy engine just when vLLM copies the
        step's sampled tokens to the host, and vLLM, waiting for those, could wait for ours while the GPU idles.
        Deferred, the copy runs beside the next forward pass (measured effect small: bench/RESULTS.md, run 6)."""
        if self.pending is None:
            return
        step, self.pending = self.pending, None
        states, block = None, None
        self.stream.wait_event(step.computed)
        with torch.cuda.stream(self.stream):
            for t in (step.positions, step.input_ids, step.stacked):
                if t is not None:
                    t.record_stream(self.stream)  # no reuse by the allocator before the copy ends
            positions = step.positions.to("cpu", non_blocking=True)
            input_ids = step.input_ids.to("cpu", non_blocking=True)
            deferred = step.stacked is not None and step.codec.name in NVCOMP_CODECS
            quantized = None
            if deferred:
                # nvCOMP's host API waits for its output sizes: that wait must not hold up the next forward pass
                waited = time.monotonic()
                self.encoding.device_steps.acquire()
                self.pinned.wait_s += time.monotonic() - waited  # back-pressure, like a full pinned pool
                if step.codec.name == "fp8-e4m3-ans":  # here, in the forward thread (`StepEncoding.quantize`)
                    quantized = self.encoding.quantize(step.stacked)
            elif step.stacked is not None and step.codec.on_device:
                encoded = self.encoding.encode(step.stacked, step.spans, step.codec)
                host, block = self._to_host(encoded.data, step.stacked)
                states = encoded.host_rows(host, step.codec.name)
            elif step.stacked is not None:
                host, block = self._to_host(step.stacked, step.stacked)
                states = list(host.unbind(0))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        if deferred:
            self.deliver(Step(step.requests, positions, input_ids, None, None, copied,
                              finish=lambda: self._finish_nvcomp(step, positions, input_ids, copied, quantized)))
        else:
            self.deliver(Step(step.requests, positions, input_ids, states, block, copied))

    def _finish_nvcomp(self, step: _DeviceStep, positions: torch.Tensor, input_ids: torch.Tensor,
                       copied: torch.cuda.Event, quantized: tuple[torch.Tensor, torch.Tensor] | None) -> Step:
        """An nvCOMP codec's step encoded and copied to the host, in the assembler thread; `positions`, `input_ids`:
        its host copies, and `quantized` fp8-e4m3-ans's codes and row numbers, which the forward thread queued
        (done once `copied` is)."""
        try:
            stream = self.encoding.stream
            # waited for on the host, through torch, which lets go of the GIL: nvCOMP's calls, queued behind the
            # step's kernels, would wait for them holding it, and the forward thread could launch nothing meanwhile
            copied.synchronize()
            for t in (step.stacked, *(quantized or ())):
                t.record_stream(stream)
            with torch.cuda.stream(stream):
                encoded = self.encoding.encode(step.stacked, step.spans, step.codec, quantized)
                host, block = self._to_host(encoded.data, step.stacked)
                encoded_copied = torch.cuda.Event()
                encoded_copied.record(stream)
            encoded_copied.synchronize()
        finally:
            self.encoding.device_steps.release()
        return Step(step.requests, positions, input_ids, encoded.host_rows(host, step.codec.name), block, copied)

    def _to_host(self, data: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, PinnedBlock]:
        """The one place a step becomes its host copy: `data` (the stacked states, or what a step codec made of
        them) queued on the copy stream (the caller's) into a pinned block sized by `stacked`'s width."""
        nbytes = data.numel() * data.element_size()
        block = self.pinned.take(stacked, nbytes)
        host = block.buffer[:nbytes].view(data.dtype).view(data.shape).copy_(data, non_blocking=True)
        return host, block
