"""Engine workers: long-lived processes that hold one loaded model and take shard work from the Prefect server
(Prefect task workers), so a model stays loaded across flow runs and shards go to whichever engine is free.

    eagle-states engine-worker --params params.yaml [--model DIR] [--gpus 0,1]

A worker computes a shard by planning the run's input (on storage every machine mounts), checking that the run
asks for exactly what its engine captures, and handing the shard to its engine (`EngineService`). While it
computes, it keeps a claim beside the shard's receipt fresh (`receipts/.claims/`): a coordinator that finds a
claim of a worker that is gone, or gone quiet, takes the shard as abandoned and submits it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from prefect import get_run_logger

from eagle_states import stages
from eagle_states.capture.engine import CaptureEngine, EngineHolder, EngineSettings
from eagle_states.capture.service import EngineService
from eagle_states.config import PipelineParams
from eagle_states.coordination.claims import Claim, regeneration_claim, worker_id
from eagle_states.coordination.dispatch import serving_workers
from eagle_states.coordination.loading import LoadingAnnouncement
from eagle_states.coordination.records import results_storage
from eagle_states.coordination.worker_tasks import regeneration_task, shard_task
from eagle_states.dataset import layout
from eagle_states.dataset.files import recorded_digest
from eagle_states.extraction.driver import CaptureConfig, Extraction

log = logging.getLogger("eagle_states.engine_worker")


class EngineWorker:
    """The worker's one engine and what it serves; `compute` is the body of its shard task."""

    def __init__(self, params: PipelineParams, engine_factory: Callable[[EngineSettings], CaptureEngine]):
        self.config = CaptureConfig(params)
        self.devices = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "all"
        self.service = EngineService(engine_factory(self.config.engine_settings()))
        self._plans: OrderedDict[str, Extraction] = OrderedDict()  # a few runs' plans, by their parameters
        self._lock = threading.Lock()

    def _extraction(self, params: PipelineParams) -> Extraction:
        key = params.model_dump_json()
        with self._lock:
            if key not in self._plans:
                self._plans[key] = Extraction(params)
                while len(self._plans) > 4:
                    self._plans.popitem(last=False)
            return self._plans[key]

    def compute(self, params: dict, shard_name: str, shard_key: str) -> dict:
        started = time.monotonic()
        extraction = self._extraction(PipelineParams.model_validate(params))
        if extraction.serving_key != self.config.serving_key:  # the task key says it cannot happen; checked anyway
            raise ValueError(f"shard {shard_name} was planned for another model or other settings than this "
                             f"engine serves ({self.config.params.model.path})")
        shard = extraction.planned(shard_name)
        if extraction.shard_key(shard) != shard_key:
            raise ValueError(f"shard {shard_name}: this worker plans it differently than the coordinator did "
                             "(the input changed after the run was planned?)")
        receipt, computed = extraction.receipt(shard), False
        if receipt is None:
            with Claim(layout.claim_path(extraction.out, shard_name), self.devices):
                (extraction.out / layout.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
                receipt = extraction.record(shard, self.service.compute(extraction.job(shard)))
            computed = True
        seconds = time.monotonic() - started
        tokens = sum(s["num_tokens"] for s in receipt["samples"])
        get_run_logger().info("%s of %s %s on %s (devices %s): %d tokens in %.2f s", shard_name, extraction.out,
                 "computed" if computed else "found finished", socket.gethostname(), self.devices, tokens, seconds)
        return {"shard": shard_name, "digest": recorded_digest(receipt)[1], "bytes": receipt["bytes"],
                "num_samples": len(receipt["samples"]), "num_tokens": tokens, "computed": computed,
                "worker": worker_id(), "host": socket.gethostname(), "devices": self.devices, "seconds": seconds}


    def regenerate(self, params: dict) -> dict:
        """A run's regeneration on this worker's engine, between two shard passes, under a claim beside its output
        (`regeneration_claim`) so that the coordinator sees this worker go. The coordinator holds the outputs."""
        params = PipelineParams.model_validate(params)
        if CaptureConfig(params).serving_key != self.config.serving_key:
            raise ValueError(f"a regeneration for another model or other settings than this engine serves "
                             f"({self.config.params.model.path})")
        with Claim(regeneration_claim(params), self.devices):
            outcome = self.service.run_exclusive(lambda engine: stages.regenerate(
                params, engines=EngineHolder(lambda settings: engine), hold_output=False))
        get_run_logger().info("regeneration of %s on %s (devices %s): %d conversations, %d tokens%s",
                              params.data.path, socket.gethostname(), self.devices, outcome.rows_written,
                              outcome.tokens_generated, " (found finished)" if outcome.reused else "")
        return dataclasses.asdict(outcome)


def serve(params: PipelineParams, engine_factory: Callable[[EngineSettings], CaptureEngine] = CaptureEngine,
          limit: int = 3) -> None:
    """Load the engine, then take shard tasks from the Prefect server until stopped. `limit` shard tasks run at
    once: with three, the engine always holds the next shard while the current one finishes and a finished one
    goes through Prefect's bookkeeping (two left the H200 idle for part of each shard: bench/RESULTS.md)."""
    from prefect.task_worker import TaskWorker

    # announced from before the model loads until the server lists this task worker: a run started meanwhile
    # waits for it rather than loading a second copy of the model (coordination/loading.py)
    announcement = LoadingAnnouncement(worker_id(), CaptureConfig(params).serving_key, str(params.model.path)).start()
    try:
        worker = EngineWorker(params, engine_factory)
    except BaseException:
        announcement.end()
        raise
    threading.Thread(target=_end_once_listed, args=(announcement, worker.config.serving_key), daemon=True).start()
    storage = results_storage(params.output.prefect_results)
    tasks = [shard_task(worker.compute, worker.config.serving_key, storage),
             regeneration_task(worker.regenerate, worker.config.serving_key, storage)]
    log.info("engine worker %s serves %s (layers %s, %s) as task keys %s", worker_id(), params.model.path,
             list(worker.config.layers.layer_ids), worker.config.dtype, [t.task_key for t in tasks])

    async def run():
        task_worker = TaskWorker(*tasks, limit=limit)
        keys = {t.name: t.task_key for t in tasks}
        for served in task_worker.tasks:  # TaskWorker copies its tasks, and a copy derives its key anew
            served.task_key = keys[served.name]
        await task_worker.start()

    try:
        asyncio.run(run())
    finally:
        announcement.end()
        worker.service.close()


def _end_once_listed(announcement: LoadingAnnouncement, serving_key: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if worker_id() in serving_workers(serving_key):
                break
        except Exception:  # the server away for a moment: ask again
            pass
        time.sleep(0.5)
    announcement.end()
