"""End to end as users run it: a real Prefect server on loopback, a process work pool and worker, the
deployments from prefect.yaml, and `prefect deployment run 'extract-hidden-states/demo' --watch`."""

import json
import shutil
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


def test_demo_deployment_runs_through_a_worker(tmp_path, server):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    for name in ("prefect.yaml", "params.yaml"):
        shutil.copy(REPO / name, workspace / name)
    for package in ("flows", "tasks"):
        shutil.copytree(REPO / package, workspace / package, ignore=shutil.ignore_patterns("__pycache__"))
    params = (workspace / "params.yaml").read_text().replace("  limit: null", "  limit: 12")
    (workspace / "params.yaml").write_text(params)

    def prefect(*args, timeout=300):
        done = subprocess.run([PREFECT, *args], cwd=workspace, env=server, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    prefect("work-pool", "create", "eagle-states", "--type", "process")
    prefect("global-concurrency-limit", "create", "gpu-engine", "--limit", "1")
    prefect("--no-prompt", "deploy", "--all")
    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "eagle-states"], cwd=workspace, env=server,
                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        prefect("deployment", "run", "extract-hidden-states/demo", "--watch", timeout=600)
    finally:
        stop(worker)  # a Prefect 3.7 process worker sometimes ignores the SIGTERM it forwards to itself

    manifest = json.loads((workspace / "work" / "dataset" / "manifest.json").read_text())
    assert manifest["num_samples"] == 12 and manifest["layer_ids"] == [2, 4, 5, 8]
    api = server["PREFECT_API_URL"]
    runs = httpx.post(f"{api}/flow_runs/filter", json={}).json()
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    artifacts = {a["key"]: a for a in httpx.post(f"{api}/artifacts/filter", json={}).json() if a["key"]}
    assert {"extraction-progress", "extraction-summary"} <= set(artifacts)
    assert "samples | 12" in artifacts["extraction-summary"]["data"]
    assert artifacts["extraction-progress"]["data"] == 100.0
    logs = httpx.post(f"{api}/logs/filter", json={"limit": 200}).json()
    assert any("vllm" in (entry.get("name") or "") for entry in logs), "vLLM's logs reach the flow-run logs"
    deployments = {d["name"]: d for d in httpx.post(f"{api}/deployments/filter", json={}).json()}
    assert deployments["nightly"]["schedules"][0]["active"] is False
    assert deployments["nightly"]["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
