"""The shard task that engine workers serve, defined once for both sides: the engine worker runs it, the flow run
(the coordinator) submits it. Its Prefect task key names what the worker's engine can capture (model identity,
layers, dtype, the byte-deciding settings, the capture code: `CaptureConfig.serving_key`), so the Prefect server
hands a shard only to a worker whose engine produces exactly the bytes the run asks for."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from typing import Any, Literal

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.serializers import JSONSerializer

from tasks.retry import transient_only

TASK_NAME = "extract-shard"
HEARTBEAT_S = 2.0  # a computing worker touches its claim this often


def task_key(serving_key: str) -> str:
    return f"eagle-states-shard-{serving_key[:24]}"


def results_storage(directory: str) -> str:
    """A saved local-file-system block for a results directory on storage every machine mounts: the shard tasks'
    parameters and results (small JSON records) travel through it between the coordinator and the workers."""
    from prefect.filesystems import LocalFileSystem

    path = str(Path(directory).resolve())
    name = f"eagle-states-results-{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    LocalFileSystem(basepath=path).save(name, overwrite=True)
    return f"local-file-system/{name}"


class ShardRecordSerializer(JSONSerializer):
    """JSON for the shard tasks' parameters and results (never pickles: anyone who can write the results
    directory would run code as the user otherwise). Prefect stores a submitted task's parameters with the
    submitting flow run's context, which holds the flow object and cannot be JSON; the context is left out (a
    shard task needs none of it: its task run is already linked to the flow run)."""

    type: Literal["eagle-states-json"] = "eagle-states-json"

    def dumps(self, obj: Any) -> bytes:
        if isinstance(obj, dict) and "parameters" in obj and "context" in obj:
            obj = {key: value for key, value in obj.items() if key != "context"}
        return super().dumps(obj)


def shard_task(fn: Callable, serving_key: str, storage: str) -> Task:
    """`fn(params: dict, shard_name: str, shard_key: str) -> dict` as the shard task of `serving_key`.
    The task key is set, not derived from `fn` (Prefect derives it from the function's code object, which
    differs between the two sides and with the install path): one queue per engine kind on the server."""
    made = task(fn, name=TASK_NAME, task_run_name="extract-{shard_name}", persist_result=True,
                result_storage=storage, result_serializer=ShardRecordSerializer(), cache_policy=NO_CACHE, retries=2,
                retry_delay_seconds=[2, 10], retry_condition_fn=transient_only)
    made.task_key = task_key(serving_key)
    return made


def submitted_shard(params: dict, shard_name: str, shard_key: str) -> dict:
    """The coordinator's handle on the shard task: it is submitted (`.delay`), never run in the flow run."""
    raise RuntimeError("a shard task runs on an engine worker (eagle-states engine-worker), not here")
