"""The Prefect flow on a local test server: shard tasks cached by content, one engine per run, retries that keep
the model loaded, validation failures never retried."""

import json
import signal

import pytest
from prefect.testing.utilities import prefect_test_harness

from prefect import flow

from eagle_states.capture.engine import CaptureEngine
from eagle_states.config import PipelineParams
from eagle_states.dataset.layout import shard_path
from eagle_states.dataset.manifest import read_manifest
from eagle_states.validate import ValidationFailed
from flows.extract_hidden_states import pipeline
from helpers import CountingEngines


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def pipeline_params(tmp_path, llama_model, **validate) -> PipelineParams:
    return PipelineParams.model_validate({
        "model": {"path": str(llama_model), "build_demo_if_missing": False},
        "data": {"path": str(tmp_path / "conversations.jsonl")},
        "prepare": {"out": str(tmp_path / "prepared"), "limit": 20},
        "extract": {"shard_max_tokens": 1536, "max_model_len": 2049, "max_num_batched_tokens": 512,
                    "gpu_memory_utilization": 0.2, "dtype": "float32"},
        # the report in the test's folder: the default (work/validation.json) is the checkout's own
        "validate": {"report": str(tmp_path / "validation.json"), **(validate or {"min_loss_tokens": 1})},
        "output": {"dir": str(tmp_path / "dataset"), "prefect_results": str(tmp_path / "results")}})


class FailsOnceOnThirdShard(CaptureEngine):
    """The real engine, with one injected transient failure on shard-00002."""
    failures = 0
    passes = 0

    def extract(self, jobs, **kwargs):
        FailsOnceOnThirdShard.passes += 1
        def jobs_failing_once():  # the engine's pass runs over several shards: fail when it reaches this one
            for job in jobs:
                if job.name == "shard-00002" and FailsOnceOnThirdShard.failures == 0:
                    FailsOnceOnThirdShard.failures += 1
                    raise ConnectionError("injected: lost the engine for a moment")
                yield job
        yield from super().extract(jobs_failing_once(), **kwargs)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("flow")
    params = pipeline_params(tmp, llama_model)
    result, engines_created = run_flow_with(FailsOnceOnThirdShard, params)
    return tmp, params, result, engines_created


@flow(name="extract-hidden-states")
def flow_with(params: PipelineParams, engines: CountingEngines) -> dict:
    """The pipeline flow's body with an injected engine factory (the deployed flow always uses CaptureEngine)."""
    return pipeline(params, engines)


def run_flow_with(engine_class, params, **options):
    """The flow with `engine_class` as its engine; returns its result (or state) and how many engines it made."""
    engines = CountingEngines(engine_class)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return flow_with(params, engines, **options), engines.created
    finally:  # the flow installs the project's stop (`stopping.install`) in this process: pytest's own come back
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_third_of_five_shards_fails_once_and_the_engine_is_created_once(first_run):
    tmp, params, result, engines_created = first_run
    manifest = read_manifest(tmp / "dataset")
    assert len(manifest["shards"]) == 5
    assert FailsOnceOnThirdShard.failures == 1
    assert engines_created == 1
    # one engine pass over the shards (writes overlap the next shard); it fails when it reaches shard-00002, so the
    # shard whose task was asking is computed alone (a read-ahead failure does not fail it), then a new pass
    assert FailsOnceOnThirdShard.passes == 3
    assert result["computed"] == 5 and result["cache_hits"] == 0
    assert result["validation"]["valid"]


def test_a_second_run_hits_the_cache_for_every_shard_and_loads_no_model(first_run):
    tmp, params, first, _ = first_run
    result, engines_created = run_flow_with(CaptureEngine, params)
    assert engines_created == 0
    assert result["cache_hits"] == 5 and result["computed"] == 0
    assert result["extract"] == first["extract"]


def test_a_lost_shard_is_recomputed_alone(first_run):
    tmp, params, first, _ = first_run
    shard_path(tmp / "dataset", "shard-00003").unlink()
    result, engines_created = run_flow_with(CaptureEngine, params)
    assert engines_created == 1
    assert result["computed"] == 1 and result["cache_hits"] == 4
    assert json.loads((tmp / "dataset" / "manifest.json").read_text())["shards"] == \
        read_manifest(tmp / "dataset")["shards"]



def test_damaged_shards_are_counted_exactly(first_run):
    tmp, params, first, _ = first_run
    truncated, flipped = shard_path(tmp / "dataset", "shard-00001"), shard_path(tmp / "dataset", "shard-00003")
    with open(truncated, "r+b") as f:
        f.truncate(1000)
    with open(flipped, "r+b") as f:  # same size, one byte changed: only its hash tells
        f.seek(flipped.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    result, engines_created = run_flow_with(CaptureEngine, params)
    assert engines_created == 1
    assert (result["computed"], result["repaired"], result["cache_hits"]) == (2, 2, 3)
    assert result["extract"] == first["extract"] and result["validation"]["valid"]

class Exploit:
    """Unpickling this creates a file: what a planted record could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_record_is_refused_not_run(first_run, tmp_path):
    import base64
    import pickle

    from prefect._internal.result_records import ResultRecord

    from eagle_states.extraction.driver import Extraction

    tmp, params, _, _ = first_run
    extraction = Extraction(params)
    record_path = tmp / "results" / extraction.shard_key(extraction.shards[1])
    record = json.loads(record_path.read_text())
    assert record["metadata"]["serializer"]["type"] == "eagle-states-json"
    marker = tmp_path / "ran"
    record["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle"}
    record["result"] = base64.b64encode(pickle.dumps(Exploit(marker))).decode()
    planted = json.dumps(record).encode()
    ResultRecord.deserialize(planted)  # the plant works: Prefect alone decodes it, and so runs it
    assert marker.exists()
    marker.unlink()

    record_path.write_bytes(planted)
    result, engines_created = run_flow_with(CaptureEngine, params)
    assert not marker.exists(), "the planted record was decoded"
    # Prefect takes the refused record for a cache miss: the task runs, finds its shard intact (no model load)
    # and stores its own record in place of the planted one
    assert engines_created == 0 and result["computed"] == 0 and result["validation"]["valid"]
    assert json.loads(record_path.read_text())["metadata"]["serializer"]["type"] == "eagle-states-json"


def test_validation_failures_are_not_retried_and_become_an_artifact(first_run):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    tmp, params, _, _ = first_run
    plant_a_nan_with_a_matching_receipt(tmp / "dataset", "shard-00004")  # as a capture bug would write it
    state, _ = run_flow_with(CaptureEngine, params, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValidationFailed):
        state.result()

    async def inspect():
        async with get_client() as client:
            runs = await client.read_task_runs()
            validate_runs = [r for r in runs if r.flow_run_id == state.state_details.flow_run_id
                             and r.name.startswith("validate")]
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["validation-failures"])))
            return validate_runs, artifacts
    validate_runs, artifacts = asyncio.run(inspect())
    assert len(validate_runs) == 1 and validate_runs[0].run_count == 1
    assert artifacts and "nan" in json.dumps(artifacts[0].data)


def plant_a_nan_with_a_matching_receipt(dataset, shard):
    """A NaN in one hidden state, with the shard's receipt updated to the new bytes: the extraction trusts the
    shard (its receipt matches), only validation, which reads the tensors, can find it."""
    from safetensors.torch import load_file

    from eagle_states.dataset.layout import receipt_path
    from eagle_states.dataset.shard_file import write_shard_file

    path = shard_path(dataset, shard)
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if "/hidden_states/" in k)
    tensors[key][0, 0] = float("nan")
    receipt = json.loads(receipt_path(dataset, shard).read_text())
    receipt["blake3"], receipt["bytes"] = write_shard_file(path, tensors)
    receipt_path(dataset, shard).write_text(json.dumps(receipt))


class DiesOnSecondShard(CaptureEngine):
    """The real engine; on its first attempt at shard-00001 its engine core is shut down under it."""
    killed = 0

    def extract(self, jobs, **kwargs):
        def jobs_killing_once():
            for job in jobs:
                if job.name == "shard-00001" and DiesOnSecondShard.killed == 0:
                    DiesOnSecondShard.killed += 1
                    self.llm.llm_engine.engine_core.shutdown()
                yield job
        yield from super().extract(jobs_killing_once(), **kwargs)


def test_a_dead_engine_is_restarted_once_and_the_shard_retried(tmp_path, llama_model):
    result, engines_created = run_flow_with(DiesOnSecondShard, pipeline_params(tmp_path, llama_model))
    assert DiesOnSecondShard.killed == 1
    assert engines_created == 2  # the first engine, and one restart
    assert result["computed"] == 5 and result["validation"]["valid"]



# -- regeneration in the flow: one engine for regenerating and capturing --------------------------------------------
def regenerating(params: PipelineParams, tmp_path, capture: bool) -> PipelineParams:
    return params.override({"regenerate.enabled": True, "regenerate.capture": capture,
                            "regenerate.max_new_tokens": 16, "regenerate.out": str(tmp_path / "regenerated"),
                            "output.dir": str(tmp_path / "dataset"), "output.prefect_results": str(tmp_path / "r")})


@pytest.mark.parametrize("capture", [False, True], ids=["regenerate-then-capture", "capture-while-generating"])
def test_regeneration_shares_the_runs_one_engine_and_a_rerun_is_fully_cached(tmp_path, llama_model, capture):
    params = regenerating(pipeline_params(tmp_path, llama_model), tmp_path, capture)
    result, engines_created = run_flow_with(CaptureEngine, params)
    assert engines_created == 1  # regeneration and the shards on one model load
    regenerated = result["regenerate"]
    assert result["prepare"] is None and not regenerated["reused"] and regenerated["rows_written"] == 20
    assert regenerated["turns_generated"] >= 20 and result["validation"]["valid"]
    shards = len(read_manifest(tmp_path / "dataset")["shards"])
    assert regenerated["shards_captured"] == (shards if capture else 0)
    assert result["computed"] == (0 if capture else shards)  # captured while generating: extract only finalizes
    assert read_manifest(tmp_path / "dataset")["engine"]["regenerate.capture"] is capture

    again, engines_created = run_flow_with(CaptureEngine, params)
    assert engines_created == 0
    assert again["regenerate"]["reused"] and again["computed"] == 0 and again["cache_hits"] == shards
    assert again["manifest_sha256"] == result["manifest_sha256"]
