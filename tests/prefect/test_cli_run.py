"""`eagle-states run` as a user sees it in a terminal (a real process, ephemeral Prefect): quiet, a short summary
with the skipped rows named, a cached rerun that reads nothing again, and `eagle-states info`."""

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import yaml

from eagle_states.demo import demo_conversations
from helpers import REPO

EAGLE_STATES = str(Path(sys.executable).parent / "eagle-states")


def test_a_run_is_quiet_and_ends_with_a_summary(tmp_path, llama_model):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"] = {"path": str(llama_model), "build_demo_if_missing": False}
    params["data"] = {"path": "conversations.jsonl", "format": "auto", "build_demo_if_missing": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    rows = [json.dumps(row) for row in demo_conversations(12)] + [json.dumps({"conversations": []})]
    (tmp_path / "conversations.jsonl").write_text("\n".join(rows) + "\n")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)

    def run(*args):
        done = subprocess.run([EAGLE_STATES, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout, done.stderr

    out, err = run("run")
    for noise in ("HTTP Request", "Concurrency limits", "csrf-token", "Traceback",
                  # vLLM's and torch's notes about their own set-up (#28.3), shown with -v only
                  "Triton", "LD_PRELOAD", "NUMA binding", "reduce_op", "set_num_threads", "raw prompts"):
        assert noise not in out + err, noise
    assert "1 input rows were skipped in preparation" in err
    lines = out.strip().splitlines()
    assert lines[0].startswith("work/dataset: 12 samples") and lines[0].endswith("valid")
    assert "shards       " in out and " computed (0 of them rewritten after damage), 0 already on disk" in out
    assert "12 of 13 rows; 1 skipped (no_assistant_turn: 1), reasons per row in work/prepared/skipped.jsonl" in out
    assert "speed" in out and "outputs      dataset work/dataset, prepared work/prepared" in out

    out, err = run("run")
    assert "0 computed" in out and "(unchanged since last validated)" in out
    assert "capture engine ready" not in err, "no model loaded"
    # both runs recorded, on the temporary server the command starts (its database under PREFECT_HOME)
    with contextlib.closing(sqlite3.connect(tmp_path / "prefect-home" / "prefect.db")) as db:
        runs = db.execute("SELECT state_type FROM flow_run WHERE flow_id IN "
                          "(SELECT id FROM flow WHERE name = 'extract-hidden-states')").fetchall()
    assert runs == [("COMPLETED",), ("COMPLETED",)]

    out, _ = run("info")
    assert f"{llama_model}" in out and "layer ids    [2, 4, 5, 8] (bfloat16)" in out
    assert "samples      12," in out and "validation   valid" in out
    about = json.loads(run("info", "--json")[0])
    assert about["samples"] == 12 and about["validation"].startswith("valid")
