"""The records a flow run keeps in Prefect (the shard tasks' parameters and results, the shard cache, and every
other record a flow run stores: `keep_run_records_in`) are JSON, written and read only through this module: a
record that something else wrote is refused, never decoded, on every read path Prefect has
(`JsonRecordsFileSystem`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem
from prefect.serializers import JSONSerializer

from eagle_states.extraction.stream import ShardOutcome


def results_storage(directory: str) -> str:
    """A saved JSON-only file-system block (`JsonRecordsFileSystem`) for a results directory on storage every
    machine mounts: the shard tasks' parameters and results (small JSON records) travel through it between the
    coordinator and the workers, and the shard cache lives in it."""
    block = _saved_block(directory)
    return f"{JsonRecordsFileSystem.get_block_type_slug()}/{block._block_document_name}"


def _saved_block(directory: str) -> "JsonRecordsFileSystem":
    path = str(Path(directory).resolve())
    block = JsonRecordsFileSystem(basepath=path)
    block.save(f"eagle-states-results-{hashlib.sha256(path.encode()).hexdigest()[:12]}", overwrite=True)
    return block


def keep_run_records_in(directory: str) -> None:
    """Every record the current flow run stores without a storage of its own (the flow run's result, and those
    of its tasks that name none: prepare, finalize, validate, export, ...) goes to `directory` through the
    JSON-only block, as a whole record (its metadata with it). Otherwise Prefect puts them in its default result
    storage, `PREFECT_RESULTS_LOCAL_STORAGE_PATH`, whose default in Prefect 3.7.7 is `~/.prefect/storage`
    whatever `PREFECT_HOME` says (the default is computed without the home setting), read back by a plain
    `LocalFileSystem` with whatever serializer a record names. Called at the start of the flow's body, where the
    parameters (`output.prefect_results`) are known; a flow's decorator can only name a fixed storage."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None:
        return
    # the flow run's store is what its tasks derive theirs from (`ResultStore.update_for_task`) and what its own
    # result is written with when it ends (the flow engine reads it from the context then). Prefect keeps a flow
    # run's result without its metadata (`metadata_storage`: a NullFileSystem); here it is kept whole, the only
    # layout the block reads
    context.result_store = context.result_store.model_copy(update={
        "result_storage": _saved_block(directory), "serializer": JsonRecordSerializer(), "metadata_storage": None})


class UnsafeRecord(ValueError):
    """A stored record that would be decoded by something other than this project's JSON serializer."""


class JsonRecordsFileSystem(LocalFileSystem):
    """Prefect's local file system, refusing every stored record that this project's JSON serializer did not
    write. Prefect decodes a record with the serializer the record itself names (pickle, or JSON with any decoder
    function), and a record in an older layout (no `metadata` key, or a `serializer` key beside it) with the one
    it names there or with cloudpickle when it names none: without this, whoever can write the results directory
    could run code as the user.

    Every read Prefect makes goes through `read_path`: the sync one (`ResultStore.read`, `exists`, the shard
    cache, `get_state_exception`) calls it with `_sync=True`, the async one (`ResultStore.aread`, a future's
    and a state's result, a task worker's `read_parameters`) calls `aread_path`. Both are overridden here, with
    Prefect's own dispatch between them, and both return only what `checked_record` let through."""

    _block_type_name = "Eagle States Results"

    async def aread_path(self, path: str) -> bytes:
        return checked_record(await super().aread_path(path), f"{self.basepath}/{path}")

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return checked_record(super().read_path(path, _sync=True), f"{self.basepath}/{path}")


def checked_record(content: bytes, where: str) -> bytes:
    """`content` if it is exactly a record this project writes, else `UnsafeRecord`: a JSON object of two keys,
    `metadata` (Prefect's metadata fields, its `serializer` exactly this project's `JsonRecordSerializer`) and
    `result` (the serialized JSON, a string). Checked before Prefect looks at the record, so before it picks or
    builds any serializer; what is returned is the checked record written out again, so Prefect parses what was
    checked and nothing else (no second reading of duplicate keys)."""
    from prefect._internal.result_records import ResultRecordMetadata

    def refused(why: str) -> UnsafeRecord:
        return UnsafeRecord(f"{where}: {why}; refused (only records written by eagle-states are read; delete the "
                            "file to recompute)")

    try:
        record = json.loads(content, object_pairs_hook=_without_duplicate_keys, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError):
        raise refused("not a JSON record") from None
    if not isinstance(record, dict) or set(record) != {"metadata", "result"}:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise refused(f"not an eagle-states record (keys {keys}; an older or foreign layout)")
    metadata = record["metadata"]
    if not isinstance(metadata, dict) or set(metadata) != set(ResultRecordMetadata.model_fields):
        raise refused("not an eagle-states record (its metadata has other fields)")
    serializer = metadata["serializer"]
    if serializer != _OUR_SERIALIZER:
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise refused(f"a record for serializer {kind!r}" if kind != _OUR_SERIALIZER["type"] else
                      "a record naming this project's serializer with other settings")
    if not isinstance(record["result"], str):
        raise refused("not an eagle-states record (its result is not serialized JSON)")
    try:  # what Prefect will make of the metadata: would it fail, Prefect would decode the file by other means
        ResultRecordMetadata.model_validate(metadata)
    except ValueError:
        raise refused("not an eagle-states record (its metadata does not validate)") from None
    return json.dumps(record).encode()


def _without_duplicate_keys(pairs: list) -> dict:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("a key given twice")
    return dict(pairs)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


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


_OUR_SERIALIZER = JsonRecordSerializer().model_dump(mode="json")  # exactly what its records name
_SHARD_OUTCOME = f"{ShardOutcome.__module__}.{ShardOutcome.__qualname__}"


def _decode_allowed(obj: dict) -> Any:
    if "__class__" not in obj and "__exc_type__" not in obj:
        return obj
    if obj.get("__class__") == _SHARD_OUTCOME:
        data = dict(obj["data"])
        if "sha256" in data:  # stored before shard digests were BLAKE3 (2026-12-02): the same field
            data["digest"] = data.pop("sha256")
        return ShardOutcome(**data)
    raise UnsafeRecord(f"a stored record asks for {obj.get('__class__') or obj.get('__exc_type__')!r}; only "
                       f"{_SHARD_OUTCOME} is decoded")
