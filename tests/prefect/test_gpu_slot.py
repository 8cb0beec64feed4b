"""The `gpu-engine` slot on a real Prefect server: a run that has to wait says so in its log, a crashed holder's
slot frees within its lease (60 s) and the server's lease sweep (15 s), and the wait is reported apart from
extraction time."""

import json
import re
import signal
import subprocess
import sys
import time

import yaml

from helpers import BIN, REPO, prefect_server
from eagle_states.coordination.session import GPU_SLOT_LEASE_S

HOLD = """
import contextlib, time
from eagle_states.coordination.session import hold_gpu_slot
with contextlib.ExitStack() as guard:
    hold_gpu_slot(guard)
    print("held", flush=True)
    time.sleep(600)
"""
SWEEP_S = 15  # PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS' default


def test_a_crashed_holders_slot_frees_within_the_lease_and_the_wait_is_logged(tmp_path, llama_model):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"] = {"path": str(llama_model), "build_demo_if_missing": False}
    params["prepare"]["limit"] = 8
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with prefect_server(tmp_path / "prefect-home") as env:
        subprocess.run([str(BIN / "prefect"), "gcl", "create", "gpu-engine", "--limit", "1"], env=env, check=True,
                       capture_output=True)
        holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        log = open(tmp_path / "run.log", "w")
        started = time.monotonic()
        run = subprocess.Popen([str(BIN / "eagle-states"), "run", "--json"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.time() + 300
        while "waiting for a free 'gpu-engine' slot" not in (tmp_path / "run.log").read_text():
            assert time.time() < deadline and run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        holder.send_signal(signal.SIGKILL)  # a crash: the slot is never released, only its lease runs out
        holder.wait()
        out, _ = run.communicate(timeout=600)
        wall = time.monotonic() - started
    text = (tmp_path / "run.log").read_text()
    assert run.returncode == 0, text[-3000:]
    waited = float(re.search(r"got the 'gpu-engine' slot after ([\d.]+) s", text).group(1))
    assert waited <= GPU_SLOT_LEASE_S + SWEEP_S + 30  # the lease may have been renewed just before the kill
    summary = json.loads(out.strip().splitlines()[-1])
    assert abs(summary["stage_seconds"]["gpu_slot_wait"] - waited) < 2
    # the stages follow one another: counted in both the wait and the extraction, they would outlast the run
    assert sum(summary["stage_seconds"].values()) <= wall, "the wait is taken out of the extraction time"
    print(f"the slot came {waited:.1f} s after the wait began (its holder killed then)")
