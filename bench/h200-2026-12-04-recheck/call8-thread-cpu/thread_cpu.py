"""CPU time per thread group of a process tree, sampled while a bench runs: which threads are busy while the
capture into RAM runs behind (the writers, their I/O threads, the forward thread, vLLM's loop).

    python3 thread_cpu.py OUT.txt -- COMMAND...   (runs COMMAND, samples its tree every 0.25 s)

Python threads get their names in the kernel from `bench/thread_names/sitecustomize.py` on PYTHONPATH. As run on
the H200 (2026-12-04, after `source bench/h200_env.sh; make_dsv3`, D=bench/h200-2026-12-04-recheck/call8-thread-cpu;
the sitecustomize was in $D/names then):

    PYTHONPATH=$PWD/bench/thread_names:$PYTHONPATH python3 $D/thread_cpu.py $OUT/thread_cpu.txt -- \
        python3 -m eagle_states bench --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 --shard-max-tokens 16384 \
        --rounds 2 --codecs none --json $OUT/shm-cpu.json
"""
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from thread_waits import tasks  # noqa: E402  (the tree's threads: the same walk as when this ran)

TICK = os.sysconf("SC_CLK_TCK")


def threads(root: int):
    """{thread's /proc folder: (its name, its CPU seconds)}."""
    out = {}
    for base, stat in tasks(root):
        fields = stat[stat.rindex(")") + 2:].split()
        out[base] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK)
    return out


def group(comm: str) -> str:
    return re.sub(r"[_-]?\d+$", "", comm)


def main():
    path, cmd = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    proc = subprocess.Popen(cmd)
    last, rows = threads(proc.pid), []
    t0 = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.25)
        now = threads(proc.pid)
        busy = defaultdict(float)
        counts = defaultdict(int)
        for key, (comm, cpu) in now.items():
            busy[group(comm)] += cpu - last.get(key, (comm, cpu))[1]
            counts[group(comm)] += 1
        last = now
        total = sum(busy.values())
        if total > 0.05:  # only the intervals where something runs (0.2 cores)
            top = sorted(busy.items(), key=lambda kv: -kv[1])[:8]
            rows.append(f"{time.monotonic() - t0:7.2f} s  cores {total / 0.25:5.1f} | " + ", ".join(
                f"{name} x{counts[name]} {b / 0.25:.2f}" for name, b in top if b > 0))
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
