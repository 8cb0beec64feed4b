"""Prefect's stored records (issue #30). No read path of Prefect's own (a result store's sync and async reads, its
existence check, a task worker reading a shard's parameters, a future's and a state's result, the shard cache)
decodes a record that this project did not write: a planted one is refused with `UnsafeRecord` and never run. A
record this project wrote reads back on every one of them. And a run stores every record under
`output.prefect_results`, none in Prefect's default storage (which Prefect 3.7.7 puts in `~/.prefect/storage`
whatever `PREFECT_HOME` says)."""

import asyncio
import base64
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import cloudpickle
import pytest
import yaml
from prefect._internal.result_records import ResultRecord
from prefect.results import ResultStore
from prefect.testing.utilities import prefect_test_harness

from eagle_states.coordination.records import (JsonRecordSerializer, JsonRecordsFileSystem, UnsafeRecord,
                                               results_storage)
from eagle_states.coordination.worker_tasks import shard_task
from eagle_states.demo import demo_conversations
from eagle_states.extraction.stream import ShardOutcome
from helpers import REPO

EAGLE_STATES = str(Path(sys.executable).parent / "eagle-states")
OUTCOME = ShardOutcome("shard-00000", "ab" * 32, 1234, 3, 456, True)


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def results(tmp_path, prefect_server):
    """A results directory and its saved JSON-only block, as a run makes them (`results_storage`)."""
    directory = tmp_path / "results"
    block = JsonRecordsFileSystem.load(results_storage(str(directory)).split("/", 1)[1])
    return directory, block


def store_on(block) -> ResultStore:
    """A fresh result store on `block` (nothing cached in memory), as Prefect builds one to read a record."""
    return ResultStore(result_storage=block, serializer=JsonRecordSerializer())


class RunsACommand:
    """Unpickling this runs a shell command that creates `marker`: what a planted record could run instead."""

    def __init__(self, marker: Path):
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self):
        return os.system, (self.command,)


def a_good_record(block, key: str) -> dict:
    """A record this project writes: our serializer, through Prefect's own write path."""
    store = store_on(block)
    store.persist_result_record(store.create_result_record(OUTCOME, key=key))
    return json.loads(Path(block.basepath, key).read_bytes())


def planted(kind: str, good: dict, marker: Path) -> bytes:
    payload = base64.encodebytes(cloudpickle.dumps(RunsACommand(marker))).decode()
    pickle = {"type": "pickle", "picklelib": "cloudpickle"}
    if kind == "pickle serializer":
        record = {"metadata": {**good["metadata"], "serializer": pickle}, "result": payload}
    elif kind == "older layout":  # no `metadata` key: Prefect moves `serializer` and `data` into it
        record = {"serializer": pickle, "data": payload, "prefect_version": "2.20.0"}
    elif kind == "older layout, no serializer":  # Prefect's default for a record naming none: cloudpickle
        record = {"result": payload}
    elif kind == "a serializer beside good metadata":  # Prefect lets the top-level one replace the metadata's
        record = {**good, "serializer": pickle, "result": payload}
    else:
        raise ValueError(kind)
    return json.dumps(record).encode()


PLANTS = ["pickle serializer", "older layout", "older layout, no serializer", "a serializer beside good metadata"]


@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_record_is_live_for_prefect_alone(tmp_path, kind):
    """The plants are real attacks: Prefect's own decoding of each runs the command."""
    marker = tmp_path / "ran"
    good = {"metadata": {"storage_key": "k", "expiration": None,
                         "serializer": JsonRecordSerializer().model_dump(mode="json"),
                         "prefect_version": "3.7.7", "storage_block_id": None}, "result": "{}"}
    ResultRecord.deserialize(planted(kind, good, marker))
    assert marker.exists()


def test_a_record_this_project_wrote_reads_back_on_every_path(results):
    directory, block = results
    a_good_record(block, "good")
    assert store_on(block).read("good").result == OUTCOME  # sync: the path the shard cache takes
    assert asyncio.run(store_on(block).aread("good")).result == OUTCOME  # async: futures, task workers
    assert store_on(block).exists("good") and asyncio.run(store_on(block).aexists("good"))

    from prefect.task_worker import read_parameters, store_parameters

    parameters_id = uuid.uuid4()
    data = {"parameters": {"params": {"a": 1}, "shard_name": "shard-00000", "shard_key": "k"}, "context": {"x": 1}}
    asyncio.run(store_parameters(store_on(block), parameters_id, data))
    assert asyncio.run(read_parameters(store_on(block), parameters_id)) == {"parameters": data["parameters"]}


def test_a_shard_outcome_stored_before_blake3_digests_reads_back():
    """Records of shard tasks stored when the digest field was `sha256` are cache hits still, not errors."""
    serializer = JsonRecordSerializer()
    stored = json.loads(serializer.dumps(OUTCOME))
    assert stored["data"].pop("digest") == OUTCOME.digest
    stored["data"]["sha256"] = OUTCOME.digest
    assert serializer.loads(json.dumps(stored).encode()) == OUTCOME


@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_record_is_refused_on_every_read_path(results, tmp_path, kind):
    from prefect._internal.result_records import ResultRecordMetadata
    from prefect.task_worker import read_parameters

    directory, block = results
    good = a_good_record(block, "target")
    marker = tmp_path / "ran"
    bad = planted(kind, good, marker)
    (directory / "target").write_bytes(bad)
    (directory / "parameters").mkdir()
    parameters_id = uuid.uuid4()
    (directory / "parameters" / str(parameters_id)).write_bytes(bad)

    def refused(path: str, read):
        try:
            read()
        except UnsafeRecord:
            pass
        assert not marker.exists(), f"a planted record was decoded ({path}): its command ran"
        with pytest.raises(UnsafeRecord):
            read()

    # Prefect's async reads: what a future's and a state's result do with a stored state, a task worker with the
    # parameters of a submitted task, and a result store's own read
    refused("a stored state's result", lambda: asyncio.run(ResultStore._from_metadata(ResultRecordMetadata(
        storage_key="target", serializer=JsonRecordSerializer(), storage_block_id=block._block_document_id))))
    refused("a task worker's parameters", lambda: asyncio.run(read_parameters(store_on(block), parameters_id)))
    refused("ResultStore.aread", lambda: asyncio.run(store_on(block).aread("target")))
    # and its sync read: the shard cache's path
    refused("ResultStore.read", lambda: store_on(block).read("target"))
    assert not asyncio.run(store_on(block).aexists("target")) and not store_on(block).exists("target")
    assert not marker.exists(), "a planted record was decoded (exists)"


@pytest.mark.parametrize("change", ["our serializer with another decoder", "an extra key", "a key given twice",
                                    "an extra metadata field", "a result that is not a string"])
def test_anything_but_exactly_our_record_is_refused(results, change):
    """Not an attack by itself (our serializer ignores its stored settings), but not what this project writes."""
    directory, block = results
    good = a_good_record(block, "target")
    text = None
    if change == "our serializer with another decoder":
        good["metadata"]["serializer"]["object_decoder"] = "os.system"
    elif change == "an extra key":
        good["expiration"] = None
    elif change == "a key given twice":
        text = json.dumps(good)[:-1] + ', "result": "{}"}'
    elif change == "an extra metadata field":
        good["metadata"]["note"] = "hi"
    else:
        good["result"] = {"shard": "shard-00000"}
    (directory / "target").write_text(text or json.dumps(good))
    with pytest.raises(UnsafeRecord):
        store_on(block).read("target")
    with pytest.raises(UnsafeRecord):
        asyncio.run(store_on(block).aread("target"))


def a_shard(marker: Path):
    def compute(params: dict, shard_name: str, shard_key: str) -> dict:
        marker.touch()  # the shard task ran
        return {"shard": shard_name, "key": shard_key, **params}
    return compute


def test_a_task_worker_refuses_planted_parameters_and_a_future_a_planted_result(results, tmp_path, caplog):
    """The engine-worker path: the coordinator submits (`delay`), a task worker reads the parameters record and
    runs the task, the coordinator's future reads the result record."""
    from prefect.client.orchestration import get_client
    from prefect.futures import PrefectDistributedFuture
    from prefect.task_worker import TaskWorker

    directory, _ = results
    storage = results_storage(str(directory))
    ran, planted_ran = tmp_path / "task-ran", tmp_path / "planted-ran"
    task = shard_task(a_shard(ran), "test-serving-key-" + uuid.uuid4().hex, storage)

    async def task_run(future):
        async with get_client() as client:
            return await client.read_task_run(future.task_run_id)

    def on_a_worker(run):
        async def execute():
            worker = TaskWorker(task)
            for served in worker.tasks:  # as coordination.engine_worker.serve: a copy derives its key anew
                served.task_key = task.task_key
            await worker.execute_task_run(run)
        asyncio.run(execute())

    # a good submission runs, and its result reads back through the future
    future = task.delay({"a": 1}, "shard-00000", "k0")
    on_a_worker(asyncio.run(task_run(future)))
    assert ran.exists()
    # the server records a worker's states from its events, a moment later (on a busy machine, after this line):
    # a future read before that refuses ("has no state"), so the coordinator polls first (`dispatch`), as here
    deadline = time.monotonic() + 60
    while (state := asyncio.run(task_run(future)).state) is None or not state.is_final():
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert future.result(timeout=60) == {"shard": "shard-00000", "key": "k0", "a": 1}

    # its stored result replaced by a plant: a fresh future (the coordinator's poll) refuses it
    result_file = directory / asyncio.run(task_run(future)).state.data.storage_key
    good = json.loads(result_file.read_bytes())
    assert good["metadata"]["serializer"]["type"] == "eagle-states-json"
    result_file.write_bytes(planted("pickle serializer", good, planted_ran))
    with pytest.raises(UnsafeRecord):
        try:
            PrefectDistributedFuture(future.task_run_id).result(timeout=60)
        finally:
            assert not planted_ran.exists(), "the future decoded a planted result: its command ran"

    # a submission whose parameters record is replaced by a plant: the worker refuses it and runs nothing
    ran.unlink()
    future = task.delay({"a": 2}, "shard-00001", "k1")
    run = asyncio.run(task_run(future))  # read once: a worker deletes a task run whose parameters it refuses
    parameters = directory / "parameters" / str(run.state.state_details.task_parameters_id)
    assert json.loads(parameters.read_bytes())["metadata"]["serializer"]["type"] == "eagle-states-json"
    for kind in PLANTS:
        parameters.write_bytes(planted(kind, good, planted_ran))
        caplog.clear()
        on_a_worker(run)
        assert not planted_ran.exists(), f"planted parameters ({kind}) were decoded"
        assert not ran.exists(), "the task ran with planted parameters"
        refusals = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], UnsafeRecord)]
        assert refusals and "Failed to read parameters" in refusals[0].getMessage(), kind


def test_the_shard_cache_hits_and_a_planted_cache_entry_is_a_miss(results, tmp_path):
    """The shard cache (`tasks.extract.extract_shard_task`'s options: keyed by the shard key, results in the
    run's JSON-only storage) is read on Prefect's sync path."""
    from prefect import task

    directory, _ = results
    storage = results_storage(str(directory))
    calls = []

    @task(cache_key_fn=lambda context, parameters: parameters["shard_key"], persist_result=True,
          result_serializer=JsonRecordSerializer(), result_storage=storage)
    def shard(shard_name: str, shard_key: str) -> ShardOutcome:
        calls.append(shard_name)
        return OUTCOME

    key = f"shard-key-{uuid.uuid4().hex}"
    first = shard("shard-00000", key, return_state=True)
    assert first.name == "Completed" and first.result() == OUTCOME
    second = shard("shard-00000", key, return_state=True)
    assert second.name == "Cached" and second.result() == OUTCOME and calls == ["shard-00000"]

    marker = tmp_path / "ran"
    good = json.loads((directory / key).read_bytes())
    for kind in PLANTS:
        (directory / key).write_bytes(planted(kind, good, marker))
        state = shard("shard-00000", key, return_state=True)
        assert not marker.exists(), f"a planted cache entry ({kind}) was decoded"
        assert state.name == "Completed" and state.result() == OUTCOME  # a miss: computed, and stored again
        assert json.loads((directory / key).read_bytes())["metadata"]["serializer"]["type"] == "eagle-states-json"


# -- where a run's records go -----------------------------------------------------------------------------------------
def test_a_flow_runs_records_go_to_its_results_directory_and_read_back_from_the_api(results, tmp_path):
    """The flow's way (`keep_run_records_in` at the start of its body): the flow run's result and its tasks' go
    to the run's results directory as whole JSON records; the flow run's state, as the API keeps it (what a UI or
    another process reads), reads back through the JSON-only block, and a plant there is refused."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client

    from eagle_states.coordination.records import keep_run_records_in

    directory, _ = results

    @task
    def a_step(x: int) -> dict:
        return {"x": x}

    @flow(persist_result=True, result_serializer=JsonRecordSerializer())
    def a_run(records: str) -> dict:
        keep_run_records_in(records)
        return {"step": a_step(1)}

    state = a_run(str(directory), return_state=True)
    assert state.is_completed()
    records = sorted(p for p in directory.rglob("*") if p.is_file())
    assert len(records) == 2  # the task's and the flow run's
    for record in records:
        assert json.loads(record.read_bytes())["metadata"]["serializer"]["type"] == "eagle-states-json"

    async def stored_state():
        async with get_client() as client:
            return (await client.read_flow_run(state.state_details.flow_run_id)).state
    kept = asyncio.run(stored_state())
    assert kept.data.storage_block_id is not None  # the block, not Prefect's default storage
    assert kept.result() == {"step": {"x": 1}}
    assert asyncio.run(asyncio.run(stored_state()).aresult()) == {"step": {"x": 1}}

    marker = tmp_path / "ran"
    result_file = directory / kept.data.storage_key
    result_file.write_bytes(planted("pickle serializer", json.loads(result_file.read_bytes()), marker))
    with pytest.raises(UnsafeRecord):
        try:
            asyncio.run(stored_state()).result()
        finally:
            assert not marker.exists(), "a planted flow-run result was decoded"


def test_a_run_stores_its_records_under_output_prefect_results_only(tmp_path, llama_model):
    """`eagle-states run` (the flow, its tasks, a temporary Prefect server) with HOME and PREFECT_HOME in temporary
    folders: no record in `$HOME/.prefect/storage` (Prefect 3.7.7's default, whatever PREFECT_HOME says) nor in
    `$PREFECT_HOME/storage`; every record is under `output.prefect_results`, JSON of our serializer."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"] = {"path": str(llama_model), "build_demo_if_missing": False}
    params["data"] = {"path": "conversations.jsonl", "format": "auto", "build_demo_if_missing": False}
    params["prepare"]["limit"] = 4
    params["output"]["prefect_results"] = str(tmp_path / "records")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "conversations.jsonl").write_text("\n".join(json.dumps(row) for row in demo_conversations(4)) + "\n")
    home, prefect_home = tmp_path / "home", tmp_path / "prefect-home"
    home.mkdir()
    real_home = Path.home()
    env = {**os.environ, "HOME": str(home), "PREFECT_HOME": str(prefect_home),
           # the caches stay where they are (a cold vLLM compile cache would only make this slower)
           "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(real_home / ".cache" / "vllm")),
           "HF_HOME": os.environ.get("HF_HOME", str(real_home / ".cache" / "huggingface"))}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_RESULTS_LOCAL_STORAGE_PATH", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    done = subprocess.run([EAGLE_STATES, "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    for default in (home / ".prefect" / "storage", prefect_home / "storage"):
        stray = sorted(str(p.relative_to(default)) for p in default.rglob("*") if p.is_file()) \
            if default.exists() else []
        assert not stray, f"{len(stray)} records in Prefect's default storage {default}: {stray[:5]}"
    records = [p for p in (tmp_path / "records").rglob("*") if p.is_file()]
    assert len(records) >= 3  # the shard, the tasks of the flow run, the flow run's result
    for record in records:
        assert json.loads(record.read_bytes())["metadata"]["serializer"]["type"] == "eagle-states-json", record
