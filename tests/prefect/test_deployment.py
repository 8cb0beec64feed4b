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
        self.worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "eagle-states"], cwd=self.workspace,
                                       env=env, stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
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
    logs = deployed.api("logs/filter", limit=200)
    assert any("vllm" in (entry.get("name") or "") for entry in logs), "vLLM's logs reach the flow-run logs"
    deployments = {d["name"]: d for d in deployed.api("deployments/filter")}
    assert deployments["nightly"]["schedules"][0]["active"] is False
    assert deployments["nightly"]["schedules"][0]["schedule"]["cron"] == "0 3 * * *"


def test_a_run_cancelled_from_the_ui_stops_within_seconds(tmp_path, server):
    deployed = Deployed(tmp_path, server, limit=64)
    receipts = deployed.workspace / "work" / "dataset" / "receipts"
    try:
        out = deployed.prefect("deployment", "run", "extract-hidden-states/demo")
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        deadline = time.time() + 400
        while not list(receipts.glob("*.json")):
            assert time.time() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
        before = sorted(p.name for p in receipts.parent.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
        cancelled = time.monotonic()
        deployed.prefect("flow-run", "cancel", run_id)  # what the UI's Cancel button does
        while (state := httpx.get(f"{server['PREFECT_API_URL']}/flow_runs/{run_id}").json()["state"])["type"] \
                not in ("CANCELLED", "CRASHED", "FAILED", "COMPLETED"):
            assert time.monotonic() - cancelled < 60, state
            time.sleep(0.2)
        seconds = time.monotonic() - cancelled
        time.sleep(3)  # anything still running would write now
        after = sorted(p.name for p in receipts.parent.rglob("*") if p.is_file())
    finally:
        deployed.stop()
    print(f"cancelled from the API: {state['type']} after {seconds:.1f} s")
    assert state["type"] == "CANCELLED"
    assert seconds < 15
    assert after == before, "nothing written after the cancel, no temporary file left"
