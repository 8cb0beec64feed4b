"""The shard task that engine workers serve, defined once for both sides: the engine worker runs it, the flow run
(the coordinator) submits it. Its Prefect task key names what the worker's engine can capture (model identity,
layers, dtype, the byte-deciding settings, the capture code: `CaptureConfig.serving_key`), so the Prefect server
hands a shard only to a worker whose engine produces exactly the bytes the run asks for.

Shard records (parameters, results, the shard cache) are JSON, written and read only through this module: a
record that something else wrote is refused, never decoded (`JsonRecordsFileSystem`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Literal

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.filesystems import LocalFileSystem
from prefect.serializers import JSONSerializer

from eagle_states.extraction.stream import ShardOutcome

from tasks.retry import transient_only

TASK_NAME = "extract-shard"
HEARTBEAT_S = 2.0  # a computing worker touches its claim this often


def task_key(serving_key: str) -> str:
    return f"eagle-states-shard-{serving_key[:24]}"


def results_storage(directory: str) -> str:
    """A saved JSON-only file-system block (`JsonRecordsFileSystem`) for a results directory on storage every
    machine mounts: the shard tasks' parameters and results (small JSON records) travel through it between the
    coordinator and the workers, and the shard cache lives in it."""
    path = str(Path(directory).resolve())
    name = f"eagle-states-results-{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    JsonRecordsFileSystem(basepath=path).save(name, overwrite=True)
    return f"{JsonRecordsFileSystem.get_block_type_slug()}/{name}"


class UnsafeRecord(ValueError):
    """A stored record that would be decoded by something other than this project's JSON serializer."""


class JsonRecordsFileSystem(LocalFileSystem):
    """Prefect's local file system, refusing every stored record that this project's JSON serializer did not
    write. Prefect decodes a record with the serializer the record itself names (pickle, or JSON with any decoder
    function): without this, whoever can write the results directory could run code as the user."""

    _block_type_name = "Eagle States Results"

    def read_path(self, path: str) -> bytes:
        content = super().read_path(path)
        try:
            record = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            raise UnsafeRecord(f"{self.basepath}/{path}: not a JSON record; refused (only records written by "
                               "eagle-states are read; delete the file to recompute)") from None
        if isinstance(record, dict) and "metadata" in record:  # a result record (else: a task's parameters)
            serializer = (record.get("metadata") or {}).get("serializer") or {}
            if serializer.get("type") != JsonRecordSerializer.model_fields["type"].default:
                raise UnsafeRecord(f"{self.basepath}/{path}: a record for serializer {serializer.get('type')!r}; "
                                   "refused (only eagle-states JSON records are read; delete the file to recompute)")
        return content


class JsonRecordSerializer(JSONSerializer):
    """JSON for the shard tasks' parameters and results (never pickles: anyone who can write the results
    directory would run code as the user otherwise). Decoding uses the standard library and builds no object but
    a `ShardOutcome`, whatever a stored record's serializer fields say. Prefect stores a submitted task's
    parameters with the submitting flow run's context, which holds the flow object and cannot be JSON; the context
    is left out (a shard task needs none of it: its task run is already linked to the flow run)."""

    type: Literal["eagle-states-json"] = "eagle-states-json"

    def dumps(self, obj: Any) -> bytes:
        if isinstance(obj, dict) and "parameters" in obj and "context" in obj:
            obj = {key: value for key, value in obj.items() if key != "context"}
        return super().dumps(obj)

    def loads(self, blob: bytes) -> Any:
        return json.loads(blob.decode(), object_hook=_decode_allowed)


_SHARD_OUTCOME = f"{ShardOutcome.__module__}.{ShardOutcome.__qualname__}"


def _decode_allowed(obj: dict) -> Any:
    if "__class__" not in obj and "__exc_type__" not in obj:
        return obj
    if obj.get("__class__") == _SHARD_OUTCOME:
        return ShardOutcome(**obj["data"])
    raise UnsafeRecord(f"a stored record asks for {obj.get('__class__') or obj.get('__exc_type__')!r}; only "
                       f"{_SHARD_OUTCOME} is decoded")


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
