"""Where a process tree's threads spend their time, by thread name: CPU time, and for threads not on a CPU, the
kernel function they sleep in (`/proc/PID/task/TID/wchan`, and the top of `stack` where it is readable: root).
For the capture into RAM, whose shard writers wait for their file's `write` calls with their threads mostly off
the CPU (bench/RESULTS.md, 2026-12-04, thirteenth): what those calls sleep on.

    python3 bench/thread_waits.py OUT.txt [--interval 0.05] -- COMMAND...

Python threads are named in the kernel by `bench/thread_names/sitecustomize.py` (put its folder first on
PYTHONPATH); without it they all read "python". Writes, at the end, a table per thread group:
the samples on a CPU, and the most frequent places asleep.
"""
import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict


def tree(root: int) -> list[int]:
    """The process and its descendants, by parent pid (as `bench.TreeRss` finds vLLM's engine core): /proc's
    `children` lists only those a process's main thread started."""
    import psutil

    try:
        return [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    except psutil.Error:  # the command just ended
        return []


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def tasks(root: int):
    """(its /proc folder, its stat line) for each thread of the tree."""
    for pid in tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            stat = read(f"{base}/stat")
            if stat:
                yield base, stat


def sample(root: int, places: dict, running: Counter, total: Counter) -> None:
    for base, stat in tasks(root):
        name = re.sub(r"[_-]?\d+$", "", stat[stat.index("(") + 1:stat.rindex(")")])
        state = stat[stat.rindex(")") + 2]
        total[name] += 1
        if state == "R":
            running[name] += 1
            continue
        frames = [line.split("] ", 1)[-1].split("+")[0] for line in read(f"{base}/stack").splitlines()[:4]]
        place = " < ".join(frames) if frames else read(f"{base}/wchan") or "?"
        places[name][f"{state} {place}"] += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--only", default="shard-io,eagle-writer,eagle-assembler",
                        help="thread groups to report (comma-separated; empty: all)")
    split = sys.argv.index("--")
    args, command = parser.parse_args(sys.argv[1:split]), sys.argv[split + 1:]
    proc = subprocess.Popen(command)
    places, running, total = defaultdict(Counter), Counter(), Counter()
    while proc.poll() is None:
        sample(proc.pid, places, running, total)
        time.sleep(args.interval)
    only = [g for g in args.only.split(",") if g]
    lines = []
    for name in sorted(total, key=lambda n: -total[n]):
        if only and name not in only:
            continue
        lines.append(f"{name}: {total[name]} thread samples, {running[name]} on a CPU (R)")
        for place, count in places[name].most_common(8):
            lines.append(f"  {count:6d}  {place}")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
