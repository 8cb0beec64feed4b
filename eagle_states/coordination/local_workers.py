"""`extract.data_parallel_size` engine workers on this machine (one per GPU group, one per core group on the CPU
build), started for one extraction and stopped after it: the same Prefect path as engine workers started by
hand, so shards go to whichever engine is free."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from eagle_states.capture.engine import running_on_cpu
from eagle_states.config import PipelineParams
from eagle_states.coordination.dispatch import serving_workers

log = logging.getLogger("eagle_states.local_workers")
START_TIMEOUT_S = 900.0  # a worker loads its model before it subscribes


def device_groups(count: int, tp_size: int, gpu_ids: list[int] | None, cpu: bool) -> list[dict[str, str]]:
    """The environment each engine worker gets: its GPUs, or its CPU cores on the CPU build."""
    if cpu:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < count * tp_size:
            raise ValueError(f"{count} engines x {tp_size} ranks need {count * tp_size} cores, {len(cores)} are "
                             "available")
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores[r * tp_size:(r + 1) * tp_size])}
                for r in range(count)]
    ids = gpu_ids if gpu_ids else list(range(count * tp_size))
    if len(ids) < count * tp_size:
        raise ValueError(f"{count} engines x {tp_size} GPUs need {count * tp_size} GPU ids, got {ids}")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in ids[r * tp_size:(r + 1) * tp_size])}
            for r in range(count)]


def api_url() -> str:
    """The Prefect API this process uses; in ephemeral mode, the temporary server's (started if need be)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


@contextlib.contextmanager
def local_engine_workers(params: PipelineParams, serving_key: str, count: int):
    """Start `count` engine workers for `params`, wait until the Prefect server lists them all, stop them after."""
    e = params.extract
    groups = device_groups(count, e.tensor_parallel_size, e.gpu_ids, running_on_cpu())
    url = api_url()
    with tempfile.TemporaryDirectory(prefix="eagle-workers-") as tmp:
        params_file = Path(tmp) / "params.yaml"
        params_file.write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
        procs = []
        try:
            for rank, env in enumerate(groups):
                log_file = open(Path(tmp) / f"worker-{rank}.log", "w")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "eagle_states", "engine-worker", "--params", str(params_file)],
                    env={**os.environ, **env, "PREFECT_API_URL": url}, stdout=log_file, stderr=subprocess.STDOUT,
                    start_new_session=True))
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(serving_workers(serving_key)) < count:
                failed = [i for i, p in enumerate(procs) if p.poll() is not None]
                if failed or time.monotonic() > deadline:
                    logs = (Path(tmp) / f"worker-{(failed or [0])[0]}.log").read_text()[-3000:]
                    raise RuntimeError(f"engine workers {failed or 'all'} did not start:\n{logs}")
                time.sleep(1)
            log.info("%d local engine workers serve %s", count, params.model.path)
            yield
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
