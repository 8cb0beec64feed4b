"""Data-parallel extraction: N engines (one per GPU or GPU group, or per CPU core on the CPU build), each in its
own process, each taking a disjoint set of the unfinished shards of one dataset.

Shards are the unit of work and of caching (receipts), and a shard's bytes depend only on its samples, so a run on
N engines writes the same files as a run on one. Shards an engine did not finish (it crashed) are picked up by a
second round; then the index and manifest are written once, by the driver.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from eagle_states.config import PipelineParams
from eagle_states.extraction.driver import Extraction

log = logging.getLogger(__name__)


def device_groups(dp_size: int, tp_size: int, gpu_ids: list[int] | None, cpu: bool) -> list[dict[str, str]]:
    """The environment each engine process gets: its GPUs, or its CPU cores on the CPU build."""
    if cpu:
        cores = os.sched_getaffinity(0)
        if len(cores) < dp_size * tp_size:
            raise ValueError(f"{dp_size} engines x {tp_size} ranks need {dp_size * tp_size} cores, "
                             f"{len(cores)} are available")
        ordered = sorted(cores)
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in ordered[r * tp_size:(r + 1) * tp_size])}
                for r in range(dp_size)]
    ids = gpu_ids if gpu_ids else list(range(dp_size * tp_size))
    if len(ids) < dp_size * tp_size:
        raise ValueError(f"{dp_size} engines x {tp_size} GPUs need {dp_size * tp_size} GPU ids, got {ids}")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in ids[r * tp_size:(r + 1) * tp_size])}
            for r in range(dp_size)]


def _engine_process(env: dict, params: PipelineParams, shard_names: list[str]):
    os.environ.update(env)  # before vLLM starts: which devices or cores this engine owns
    from eagle_states.capture.engine import EngineHolder

    extraction = Extraction(params)
    shards = {s.name: s for s in extraction.shards}
    engines = EngineHolder()
    try:
        for result in engines(extraction.engine_settings()).extract([extraction.job(shards[n]) for n in shard_names]):
            extraction.record(shards[result.name], result)
    finally:
        engines.close()


def run_data_parallel(params: PipelineParams, rounds: int = 2) -> dict:
    from eagle_states.capture.engine import running_on_cpu

    e = params.extract
    dp_size = e.data_parallel_size
    extraction = Extraction(params)
    groups = device_groups(dp_size, e.tensor_parallel_size, e.gpu_ids, running_on_cpu())
    context = multiprocessing.get_context("spawn")
    for round_ in range(rounds):
        todo = [s.name for s in extraction.unfinished()]
        if not todo:
            break
        extraction.begin()
        procs = []
        for rank, env in enumerate(groups):
            names = todo[rank::dp_size]
            if names:
                proc = context.Process(target=_engine_process, name=f"eagle-engine-{rank}",
                                       args=(env, params, names))
                proc.start()
                procs.append((rank, proc))
        for rank, proc in procs:
            proc.join()
            if proc.exitcode:
                log.warning("engine %d exited with %s; its unfinished shards go to the next round", rank,
                            proc.exitcode)
    left = [s.name for s in extraction.unfinished()]
    if left:
        raise RuntimeError(f"{len(left)} shards unfinished after {rounds} rounds: {left[:5]}")
    return extraction.finalize()
