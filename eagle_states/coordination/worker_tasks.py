"""The two tasks that engine workers serve, defined once for both sides: the engine worker runs them, the flow run
(the coordinator) submits them (`.delay()`). Their Prefect task key names what the worker's engine can capture
(model identity, layers, dtype, the byte-deciding settings, the capture format: `CaptureConfig.serving_key`), so
the Prefect server hands a shard only to a worker whose engine produces exactly the bytes the run asks for."""

from __future__ import annotations

from typing import Callable

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from eagle_states.coordination.records import JsonRecordSerializer
from eagle_states.coordination.retry import transient_only

TASK_NAME = "extract-shard"


def task_key(serving_key: str) -> str:
    return f"eagle-states-shard-{serving_key[:24]}"


def shard_task(fn: Callable, serving_key: str, storage: str) -> Task:
    """`fn(params: dict, shard_name: str, shard_key: str) -> dict` as the shard task of `serving_key`.
    The task key is set, not derived from `fn` (Prefect derives it from the function's code object, which
    differs between the two sides and with the install path): one queue per engine kind on the server."""
    made = task(fn, name=TASK_NAME, task_run_name="extract-{shard_name}", tags=["eagle-states", "extract"],
                persist_result=True,
                result_storage=storage, result_serializer=JsonRecordSerializer(), cache_policy=NO_CACHE, retries=2,
                retry_delay_seconds=[2, 10], retry_condition_fn=transient_only)
    made.task_key = task_key(serving_key)
    return made


def submitted_shard(params: dict, shard_name: str, shard_key: str) -> dict:
    """The coordinator's handle on the shard task: it is submitted (`.delay`), never run in the flow run."""
    raise RuntimeError("a shard task runs on an engine worker (eagle-states engine-worker), not here")


def regeneration_task(fn: Callable, serving_key: str, storage: str) -> Task:
    """`fn(params: dict) -> dict` (a `stages.RegenerateOutcome`) as the regeneration task of `serving_key`: a
    run's regeneration on an engine worker's engine, the one its shards then use. Not retried by Prefect: the
    coordinator submits it again if its worker goes."""
    made = task(fn, name="regenerate", task_run_name="regenerate", tags=["eagle-states", "regenerate"],
                persist_result=True, result_storage=storage, result_serializer=JsonRecordSerializer(),
                cache_policy=NO_CACHE)
    made.task_key = f"eagle-states-regenerate-{serving_key[:24]}"
    return made


def submitted_regeneration(params: dict) -> dict:
    """The coordinator's handle on the regeneration task: submitted (`.delay`), never run in the flow run."""
    raise RuntimeError("a regeneration task runs on an engine worker (eagle-states engine-worker), not here")
