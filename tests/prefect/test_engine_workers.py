"""Engine workers on a real `prefect server start` on loopback: three worker processes, each with its own working
directory and environment (a fast one and a slowed one for the model, one for another model), fed by real
`eagle-states run` flow runs. Shards spread by who is free, a killed flow run or worker loses nothing and
reloads nothing, and the dataset is byte-identical to a one-engine run."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from eagle_states.config import PipelineParams
from eagle_states.demo import make_demo_model, write_demo_conversations
from eagle_states.extraction.driver import CaptureConfig
from helpers import BIN, REPO, prefect_server, stop
from eagle_states.coordination.worker_tasks import task_key

DELAY_S = 8.0  # the slowed worker's extra seconds per shard
SHARDS = 16
EXTRACT = {"shard_max_tokens": 1024, "max_num_batched_tokens": 512, "max_model_len": 1024, "dtype": "float32",
           "gpu_memory_utilization": 0.15}
READY = "capture engine ready"


def params_for(model: Path, tmp: Path, run: str) -> dict:
    return {"model": {"path": str(model), "build_demo_if_missing": False},
            "data": {"path": str(tmp / "conversations.jsonl"), "build_demo_if_missing": False},
            "prepare": {"out": str(tmp / run / "prepared"), "limit": 3 * SHARDS, "max_length": 1023},
            "extract": EXTRACT, "validate": {"report": str(tmp / run / "validation.json")},
            "output": {"dir": str(tmp / run / "dataset"), "prefect_results": str(tmp / "results")}}


def write_params(tmp: Path, name: str, params: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


class Cluster:
    def __init__(self, tmp: Path, env: dict, model: Path):
        self.tmp, self.env, self.model = tmp, env, model
        self.workers: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start_worker(self, name: str, params: dict, core: int, *extra: str, **extra_env: str):
        home = self.tmp / name
        home.mkdir()
        log = home / "worker.log"
        env = {**self.env, "PREFECT_HOME": str(home / "prefect"), "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "PYTHONPATH": str(REPO / "tests"), **extra_env}
        proc = subprocess.Popen([str(BIN / "eagle-states"), "engine-worker", "--params",
                                 str(write_params(home, "params", params)), *extra], cwd=home, env=env,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[name] = (proc, log)

    def serving(self, model: Path) -> list[str]:
        key = task_key(CaptureConfig(PipelineParams.model_validate(params_for(model, self.tmp, "any"))).serving_key)
        response = httpx.post(f"{self.env['PREFECT_API_URL']}/task_workers/filter",
                              json={"task_worker_filter": {"task_keys": [key]}})
        return [w["identifier"] for w in response.json()]

    def log(self, name: str) -> str:
        return self.workers[name][1].read_text()

    def computed(self, name: str, run: str) -> int:
        """Shards of `run` this worker computed (its log says so per shard)."""
        return sum(" computed on " in line and str(self.tmp / run) in line for line in self.log(name).splitlines())

    def coordinator(self, run: str, **sections) -> tuple[list[str], dict]:
        home = self.tmp / run
        home.mkdir(exist_ok=True)
        params = write_params(home, "params", {**params_for(self.model, self.tmp, run), **sections})
        env = {**self.env, "PREFECT_HOME": str(home / "prefect")}
        return [str(BIN / "eagle-states"), "run", "--json", "--params", str(params)], {"cwd": home, "env": env}

    def run(self, run: str, **sections) -> tuple[dict, str]:
        cmd, kw = self.coordinator(run, **sections)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("engine-workers")
    write_demo_conversations(tmp / "conversations.jsonl")
    other_model = make_demo_model(tmp / "models" / "other", seed=1)
    with prefect_server(tmp / "server") as env:
        cluster = Cluster(tmp, env, llama_model)
        worker_params = params_for(llama_model, tmp, "worker")
        cluster.start_worker("fast", worker_params, core=0)
        cluster.start_worker("slow", worker_params, 1, "--engine-factory", "helpers:SlowEngine",
                             SLOW_ENGINE_DELAY_S=str(DELAY_S))
        cluster.start_worker("other-model", params_for(other_model, tmp, "worker"), core=0)
        try:
            deadline = time.time() + 300
            while len(cluster.serving(llama_model)) < 2 or not cluster.serving(other_model):
                dead = [n for n, (p, _) in cluster.workers.items() if p.poll() is not None]
                assert not dead and time.time() < deadline, \
                    f"workers {dead} did not start: " + "".join(cluster.log(n)[-2000:] for n in dead)
                time.sleep(1)
            yield cluster
        finally:
            for proc, _ in cluster.workers.values():
                stop(proc)


def shard_hashes(dataset: Path) -> list[str]:
    return [s["blake3"] for s in json.loads((dataset / "manifest.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def reference(cluster):
    """The one-engine dataset of the same prepared input (`eagle-states extract`, in its own process)."""
    first, _ = cluster.run("first")
    cmd, kw = cluster.coordinator("first")
    out = cluster.tmp / "reference"
    done = subprocess.run([str(BIN / "eagle-states"), "extract", "--params", cmd[-1], "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=600,
                          **{**kw, "env": {**kw["env"], "VLLM_CPU_OMP_THREADS_BIND": "1"}})
    assert done.returncode == 0, done.stderr[-3000:]
    return first, out


def test_two_workers_take_the_shards_as_they_are_free_and_match_one_engine(cluster, reference):
    first, out = reference
    assert first["valid"] and first["computed"] == SHARDS == len(shard_hashes(out))
    assert shard_hashes(cluster.tmp / "first" / "dataset") == shard_hashes(out)
    assert (cluster.tmp / "first" / "dataset" / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()
    fast, slow = cluster.computed("fast", "first"), cluster.computed("slow", "first")
    # shards go to whoever is free: a fixed half-and-half split would give the slowed worker SHARDS / 2
    assert fast + slow == SHARDS and 1 <= slow < SHARDS // 2 < fast, (fast, slow)
    # the UI: each shard's task run logs the worker that computed it; the summary has a table of workers
    api = cluster.env["PREFECT_API_URL"]
    logs = httpx.post(f"{api}/logs/filter", json={"limit": 200, "logs": {"task_run_id": {"is_null_": False}}}).json()
    assert sum(" computed on " in entry["message"] and "(devices " in entry["message"] for entry in logs) >= SHARDS
    summaries = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["extraction-summary"]}},
                                                           "sort": "CREATED_DESC", "limit": 1}).json()
    table = summaries[0]["data"].split("## Engine workers")[1]
    assert set(first["workers"]) == {line.split(" | ")[0].strip("| ") for line in table.splitlines()[4:] if line}


def test_a_killed_flow_run_loses_nothing_and_reloads_no_model(cluster, reference):
    _, out = reference
    cmd, kw = cluster.coordinator("killed")
    receipts = cluster.tmp / "killed" / "dataset" / "receipts"
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **kw)
    deadline = time.time() + 300
    while len(list(receipts.glob("*.json"))) < 2 and run.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    finished = len(list(receipts.glob("*.json")))
    assert 2 <= finished < SHARDS, "killed mid-extraction"
    rerun, stderr = cluster.run("killed")
    assert rerun["valid"] and rerun["computed"] <= SHARDS - finished
    assert shard_hashes(cluster.tmp / "killed" / "dataset") == shard_hashes(out)
    assert READY not in stderr, "the flow run loaded no model"
    assert [cluster.log(name).count(READY) for name in cluster.workers] == [1, 1, 1], "no worker loaded twice"


def test_regeneration_runs_on_a_worker_and_the_flow_run_loads_no_model(cluster, reference):
    regenerated = cluster.tmp / "regenerated" / "regenerated"
    result, stderr = cluster.run("regenerated", regenerate={"enabled": True, "max_new_tokens": 8,
                                                            "out": str(regenerated)})
    assert result["valid"] and result["samples"] == 3 * SHARDS and result["computed"] >= 1
    assert READY not in stderr, "the flow run loaded no model"
    assert sum("regeneration of" in cluster.log(name) for name in ("fast", "slow")) == 1  # on one worker's engine
    assert [cluster.log(name).count(READY) for name in cluster.workers] == [1, 1, 1], "no worker loaded twice"
    report = json.loads((regenerated / "report.json").read_text())
    assert report["rows_written"] == 3 * SHARDS and report["turns_generated"] >= 3 * SHARDS
    assert not (regenerated.parent / ".regenerated.claim.json").exists()
    again, stderr = cluster.run("regenerated", regenerate={"enabled": True, "max_new_tokens": 8,
                                                           "out": str(regenerated)})
    assert again["computed"] == 0 and READY not in stderr  # regeneration found finished, every shard too


def claimed_by(claims: Path, pid: int) -> bool:
    """Whether a claim in `claims` names the worker process `pid` (a claim may go between listing and reading it:
    its shard finished)."""
    for claim in claims.glob("*.json"):
        try:
            if f"-{pid}" in claim.read_text():
                return True
        except FileNotFoundError:
            continue
    return False


def test_a_killed_worker_loses_nothing(cluster, reference):
    _, out = reference
    cmd, kw = cluster.coordinator("worker-killed")
    slow, _ = cluster.workers["slow"]
    claims = cluster.tmp / "worker-killed" / "dataset" / ".claims"
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    deadline = time.time() + 300
    while time.time() < deadline and not claimed_by(claims, slow.pid):
        time.sleep(0.1)
    os.killpg(slow.pid, signal.SIGKILL)  # mid-shard: its claim names it
    slow.wait()
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["valid"] and "abandoned" in stderr
    assert shard_hashes(cluster.tmp / "worker-killed" / "dataset") == shard_hashes(out)
    assert not claims.exists()


def test_a_worker_for_another_model_takes_no_shard(cluster):
    assert " computed on " not in cluster.log("other-model") and "found finished" not in cluster.log("other-model")
    assert cluster.log("other-model").count(READY) == 1


def test_a_run_started_while_a_worker_loads_its_model_waits_for_it(cluster):
    """#28.3: a run started 10-20 s after its engine worker loaded a model of its own beside it."""
    extract = {**EXTRACT, "layer_ids": [2, 4, 6, 8]}  # an engine kind no other worker serves
    cluster.start_worker("loading", {**params_for(cluster.model, cluster.tmp, "worker"), "extract": extract}, 1,
                         "--engine-factory", "helpers:SlowLoadingEngine", SLOW_LOAD_S="25")
    api = cluster.env["PREFECT_API_URL"]
    deadline = time.time() + 120
    while not any(v["name"].startswith("eagle-states-loading-")
                  for v in httpx.post(f"{api}/variables/filter", json={}).json()):
        assert time.time() < deadline and cluster.workers["loading"][0].poll() is None, cluster.log("loading")
        time.sleep(0.5)
    result, err = cluster.run("while-loading", extract=extract)
    assert "waiting for engine worker" in err and READY not in err, err[-3000:]  # no model loaded by the run
    assert result["computed"] == SHARDS == cluster.computed("loading", "while-loading")
    assert not any(v["name"].startswith("eagle-states-loading-")
                   for v in httpx.post(f"{api}/variables/filter", json={}).json()), "gone once it serves"
