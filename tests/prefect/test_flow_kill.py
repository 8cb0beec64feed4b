"""A flow run killed mid-extraction (SIGKILL, a real process) loses only its unfinished shards."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import REPO

EAGLE_STATES = str(Path(sys.executable).parent / "eagle-states")


def test_killed_run_resumes_from_finished_shards(tmp_path, llama_model):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"] = {"path": str(llama_model), "build_demo_if_missing": False}
    params["extract"].update(shard_max_tokens=1536, max_model_len=2049, max_num_batched_tokens=256)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # ephemeral mode, as `eagle-states run` is used without a server
    receipts = tmp_path / "work" / "dataset" / "receipts"

    run = subprocess.Popen([EAGLE_STATES, "run"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(receipts.glob("*.json"))) < 3 and run.poll() is None:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    finished = len(list(receipts.glob("*.json")))
    assert 3 <= finished, "the run got far enough to have finished shards"
    assert not (tmp_path / "work" / "dataset" / "manifest.json").exists(), "an unfinished dataset has no manifest"

    rerun = subprocess.run([EAGLE_STATES, "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    total = len(json.loads((tmp_path / "work" / "dataset" / "manifest.json").read_text())["shards"])
    assert finished < total
    assert summary["computed"] == total - finished and summary["valid"]
    validate = subprocess.run([EAGLE_STATES, "validate", "work/dataset", "--prepared", "work/prepared"],
                              cwd=tmp_path, env=env, capture_output=True, text=True)
    assert validate.returncode == 0, validate.stderr[-2000:]
