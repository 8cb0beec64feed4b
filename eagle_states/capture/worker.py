"""The capture worker: a vLLM worker extension (`worker_extension_cls`) that captures the residual stream.

What it relies on in vLLM (the versions checked are `CHECKED_VLLM_VERSIONS` in this package's `__init__`):
  * The extension is mixed into each worker; the driver calls its one method (`protocol.ENTRY_POINT`) through
    `collective_rpc`, and every tensor-parallel rank answers.
  * `self.model_runner` is the worker's model runner (what the forward path hooks: `forward.py` says what it
    reads of it), `self.vllm_config.parallel_config` its parallel layout, and `vllm.distributed.parallel_state`
    its tensor-parallel rank and world size.

A worker's capture is three parts behind the driver's calls (`_Capture`): the forward path (`forward.py`, the only
part that reads the model runner), the sample assembler (`assembler.py`, a thread off the forward path) and, on the
writer rank (tensor-parallel rank 0), the shard writers (`shard_writer.py`, a thread pool). What they hand each
other is `handoff.py`; data leaves workers as files, and the driver's calls and the replies are the typed messages
of `protocol.py`.
"""

from __future__ import annotations

import queue

from eagle_states.capture import protocol as p
from eagle_states.capture.assembler import Assembler
from eagle_states.capture.forward import ForwardCapture, check_model_runner, kv_cache_facts
from eagle_states.capture.protocol import CaptureError, UnsupportedModelError
from eagle_states.capture.shard_writer import WRITER_TIMES, ShardWriter
from eagle_states.dataset.kept_bytes import return_freed_memory


class _Capture:
    """A worker's capture behind the driver's calls. Steps (from the forward path) and the driver's markers reach
    the assembler through one queue, in the order they happened; the markers return at once, and a failure off the
    forward path is reported on the driver's next call."""

    def __init__(self, runner, setup: p.Setup, writer: bool, rank: int, world_size: int):
        self.writer, self.rank, self.world_size = writer, rank, world_size
        self.work: queue.Queue = queue.Queue()  # steps and shard markers, in order, for the assembler
        self.forward = ForwardCapture(runner, setup, writer, deliver=self.work.put)
        self.shards = (ShardWriter(len(setup.layer_ids), setup.write_threads, self.forward.pinned,
                                   kept_limit=setup.host_buffer_bytes) if writer else None)
        if writer and self.forward.is_cuda:
            # the kept tensors' memory goes back once freed (`kept_bytes`). Not on the CPU build: its forward
            # passes' activations are host blocks too, which glibc's moving threshold keeps from faulting anew
            # (5 x the page faults in a CPU MLP with the threshold fixed)
            return_freed_memory()
        self.assembler = Assembler(self.work, self.shards, self.forward.pinned)

    def _raise_failure(self):
        failure = self.assembler.take_failure()
        if failure is not None:
            if isinstance(failure, OSError):  # keeps its errno: a full disk is not retried
                raise OSError(failure.errno, f"capture failed on rank {self.rank}: {failure.strerror}",
                              failure.filename) from failure
            raise CaptureError(f"capture failed on rank {self.rank}: {failure}") from failure

    def _queue(self, marker: p.BeginShard | p.EndShard | p.FinishGeneration):
        """Queue a marker behind the steps already captured (their last one's copy launched first)."""
        self._raise_failure()
        self.forward.start_copy()
        self.work.put(marker)

    def begin_shard(self, call: p.BeginShard) -> p.Queued:
        """Queue a shard's plan before its requests run; returns at once. Its codec applies to the steps from
        here on (a step holds rows of one shard only)."""
        self._queue(call)
        self.forward.codec = call.codec
        return p.Queued(path=call.path)

    def end_shard(self, call: p.EndShard) -> p.Queued:
        """Queue the end of a shard behind the steps already captured (its last step's); returns at once."""
        self._queue(call)
        return p.Queued(path=call.path)

    def finish_generation(self, call: p.FinishGeneration) -> p.GenerationQueued:
        """Queue a generating request's end behind the steps already captured (its last row's step); returns at
        once."""
        self._queue(call)
        return p.GenerationQueued(key=call.key)

    def poll(self, call: p.Poll) -> p.PollReply:
        """Shards that are done (the file's hash and size from the writer rank only), and the samples whose last
        rows were launched since the last poll. `wait` blocks until every ended shard is done."""
        self.forward.start_copy()
        if call.wait:
            self.work.join()
        self._raise_failure()
        done = self.assembler.report_ended(call.wait)
        launched, self.forward.launched = self.forward.launched, []
        return p.PollReply(shards=done, launched=launched)

    def stats_reply(self, call: p.Stats) -> p.StatsReply:
        """The counters, with the forward passes so far (device time in them and idle between them); the next
        gap is counted from the next pass on (a caller reads the stats before and after what it measures, and the
        idle time before it is not counted)."""
        forward, assembler, clock = self.forward, self.assembler, self.forward.clock
        clock.restart()
        return p.StatsReply(
            steps=forward.steps, rows=assembler.rows, decode_rows_dropped=assembler.decode_rows_dropped,
            generated_rows=assembler.generated_rows, spilled_bytes=assembler.spilled_bytes,
            pinned_wait_s=forward.pinned.wait_s,
            last_forward_end=forward.last_forward_end(), backlog_bytes=forward.backlog_bytes,
            last_sample_taken=self.shards.last_taken if self.shards else 0.0,
            last_shard_written=self.shards.last_written if self.shards else 0.0, forwards=clock.forwards,
            forward_s=clock.forward_s,
            between_forwards_s=clock.between_s, encoded_bytes=self.shards.encoded_bytes if self.shards else 0,
            encode_s=self.shards.encode_s if self.shards else 0.0, **dict(zip(
                ("device_encoded_bytes", "device_encode_s"), forward.encoding.seconds())),
            **({f"writer_{key}": getattr(self.shards, key) for key in WRITER_TIMES} if self.shards else {}))

    def discard(self, call: p.Discard) -> p.Discarded:
        """Forget partial and unclaimed samples and unfinished shards (after a failure) so that a retry starts
        clean; their temp files are removed."""
        self.forward.start_copy()
        self.work.join()
        dropped = self.assembler.discard()
        self.forward.launched.clear()
        return p.Discarded(samples=dropped)


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
        runner = self.model_runner
        check_model_runner(type(runner))  # before a hook is installed
        pp_size = self.vllm_config.parallel_config.pipeline_parallel_size
        if pp_size > 1:
            raise UnsupportedModelError("pipeline parallelism is not supported: use tensor parallelism")
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self._eagle_capture = cap = _Capture(runner, call, writer=(tp_rank == 0), rank=tp_rank, world_size=world_size)
        return self._eagle_envelope(p.SetupReply(
            num_layers=cap.forward.num_layers, hidden_size=cap.forward.hidden_size, device=str(runner.device),
            vllm_version=vllm.__version__, model_runner=f"{type(runner).__module__}.{type(runner).__qualname__}",
            **kv_cache_facts(runner)))
