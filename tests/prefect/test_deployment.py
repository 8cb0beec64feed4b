"""End to end as users run it: a real Prefect server on loopback, a process work pool and worker, the
deployments from prefect.yaml, and `prefect deployment run 'extract-hidden-states/demo' --watch`."""

import json
import re
import shutil
import time
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from eagle_states.dataset.files import sha256_file
from helpers import REPO, prefect_server, stop

PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture
def server(tmp_path):
    with prefect_server(tmp_path / "prefect-home") as env:
        yield env


class Deployed:
    """The project's deployments on the server, with a process work pool, the `gpu-engine` limit and a worker."""

    def __init__(self, tmp_path, env, limit=12):
        self.env, self.workspace = env, tmp_path / "workspace"
        self.workspace.mkdir()
        for name in ("prefect.yaml", "params.yaml"):
            shutil.copy(REPO / name, self.workspace / name)
        for package in ("flows", "tasks"):
            shutil.copytree(REPO / package, self.workspace / package, ignore=shutil.ignore_patterns("__pycache__"))
        params = (self.workspace / "params.yaml").read_text().replace("  limit: null", f"  limit: {limit}")
        (self.workspace / "params.yaml").write_text(params)
        self.prefect("work-pool", "create", "eagle-states", "--type", "process")
        self.prefect("global-concurrency-limit", "create", "gpu-engine", "--limit", "1")
        self.prefect("--no-prompt", "deploy", "--all")
        # a cancel reaches the worker as an event; were the event missed, its poll (120 s by default) would find it
        # only after the test's 60 s
        self.worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "eagle-states"], cwd=self.workspace,
                                       env={**env, "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "5"},
                                       stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)

    def prefect(self, *args, timeout=300) -> str:
        done = subprocess.run([PREFECT, *args], cwd=self.workspace, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def api(self, path: str, **body):
        return httpx.post(f"{self.env['PREFECT_API_URL']}/{path}", json=body).json()

    def stop(self):
        stop(self.worker)  # a Prefect 3.7 process worker sometimes ignores the SIGTERM it forwards to itself


def test_demo_deployment_runs_through_a_worker(tmp_path, server):
    deployed = Deployed(tmp_path, server)
    try:
        deployed.prefect("deployment", "run", "extract-hidden-states/demo", "--watch", timeout=600)
    finally:
        deployed.stop()
    workspace = deployed.workspace

    manifest = json.loads((workspace / "work" / "dataset" / "manifest.json").read_text())
    assert manifest["num_samples"] == 12 and manifest["layer_ids"] == [2, 4, 5, 8]
    runs = deployed.api("flow_runs/filter")
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    artifacts = {a["key"]: a for a in deployed.api("artifacts/filter") if a["key"]}
    assert {"extraction-progress", "extraction-summary"} <= set(artifacts)
    assert "samples | 12" in artifacts["extraction-summary"]["data"]
    assert artifacts["extraction-progress"]["data"] == 100.0
    logs = [entry for offset in range(0, 2000, 200) for entry in deployed.api("logs/filter", limit=200, offset=offset)]
    assert any((entry.get("name") or "").startswith("vllm") and entry["level"] == 20 for entry in logs), \
        "vLLM's INFO lines reach the flow-run logs"
    assert any("capture engine ready" in entry["message"] for entry in logs), "so do the project's"
    run = runs[0]
    assert run["name"] == "dataset-from-demo-model"
    assert run["state"]["data"] is not None, "the flow's result is persisted"
    tasks = deployed.api("task_runs/filter")
    names = {t["name"] for t in tasks}
    shards = {n for n in names if re.fullmatch(r"extract-shard-\d{5}", n)}
    assert shards and names - shards == {"prepare", "finalize-dataset", "validate"}, names
    assert all("eagle-states" in t["tags"] for t in tasks)
    summary = artifacts["extraction-summary"]["data"]
    assert "| model | `work/demo-model` |" in summary
    assert f"| manifest sha256 | `{sha256_file(workspace / 'work' / 'dataset' / 'manifest.json')[:16]}` |" in summary
    deployments = {d["name"]: d for d in deployed.api("deployments/filter")}
    assert deployments["nightly"]["schedules"][0]["active"] is False
    assert deployments["nightly"]["schedules"][0]["schedule"]["cron"] == "0 3 * * *"


def test_a_run_cancelled_from_the_ui_stops_within_seconds(tmp_path, server):
    deployed = Deployed(tmp_path, server, limit=64)
    dataset = deployed.workspace / "work" / "dataset"
    try:
        out = deployed.prefect("deployment", "run", "extract-hidden-states/demo")
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        deadline = time.time() + 400
        while not list((dataset / "receipts").glob("*.json")):
            assert time.time() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
        cancelled = time.monotonic()
        deployed.prefect("flow-run", "cancel", run_id)  # what the UI's Cancel button does
        while (state := httpx.get(f"{server['PREFECT_API_URL']}/flow_runs/{run_id}").json()["state"])["type"] \
                not in ("CANCELLED", "CRASHED", "FAILED", "COMPLETED"):
            assert time.monotonic() - cancelled < 60, state
            time.sleep(0.2)
        seconds = time.monotonic() - cancelled
        stopped = sorted(p.name for p in dataset.rglob("*") if p.is_file())
        time.sleep(3)  # anything still running would write now
        later = sorted(p.name for p in dataset.rglob("*") if p.is_file())
    finally:
        deployed.stop()
    print(f"cancelled through the API: {state['type']} after {seconds:.1f} s")
    assert state["type"] == "CANCELLED"
    assert seconds < 30  # the worker notices the cancel on its next poll, then signals the flow-run process
    assert stopped == later, "nothing runs on after the cancel"
    assert not [name for name in stopped if name.endswith(".tmp")], "no temporary file is left"
    assert "stopped by SIGTERM" in (tmp_path / "worker.log").read_text(), "the project's stop did it"
