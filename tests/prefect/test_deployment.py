"""End to end as users run it: a real Prefect server on loopback, a process work pool and worker, the
deployments from prefect.yaml, and `prefect deployment run 'extract-hidden-states/demo' --watch`."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import REPO

PREFECT = str(Path(sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_KEY", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise RuntimeError("the Prefect server did not start: " + (tmp_path / "server.log").read_text()[-2000:])
        yield env
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


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
        stop_worker(worker)

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


def stop_worker(worker: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL: a Prefect 3.7 process worker sometimes ignores the signal it forwards to itself
    (seen once here, after its flow run had exited cleanly); its shutdown is not what this tests."""
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
