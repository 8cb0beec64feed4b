"""Shards into RAM through the real `ShardFileWriter`, side by side: tmpfs as /dev/shm is mounted (4 KiB pages)
against tmpfs mounted with huge pages (`huge=always`; `huge=within_size`, which gives a file huge pages only
within its size, and a shard grows as it is written). Each round writes `--shards` shards on as many threads at
once, keeps them until the round's end as a capture does, then removes them; targets interleaved. Prints GB/s per
target, its ratio to /dev/shm, and the huge pages the files held. Mounting needs root (the lent GPU machine, this
project's CI-like machine): without it, /dev/shm alone. Each target is written once before the rounds: both lent
machines are Firecracker microVMs, where memory the guest touches for the first time writes at 0.4-0.5 GB/s
whatever the pages (on the 2-core one), and the rounds would otherwise measure that.

On the capture into RAM a shard's file is written by one thread at 2.5-3.2 GB/s (bench/one_file_check.py, RESULTS
2026-12-04, tenth): the kernel's tmpfs write path a page at a time.

    python3 bench/huge_tmpfs_check.py [--samples 8] [--shards 1,4] [--rounds 3] [--size-gb 16]
"""

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from writer_check import TOKENS, STATES, write_shard  # noqa: E402  (this script's directory is on the path)

HIDDEN = 7168  # the DeepSeek-V3 width: a 2,048-token sample's state is 29 MB in bf16


def shmem_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def mount(options: str, size_gb: float) -> Path | None:
    """A tmpfs with `options` on a new directory, or None where it cannot be mounted."""
    where = Path(tempfile.mkdtemp(prefix="huge-tmpfs-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_gb)}G,{options}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"cannot mount tmpfs with {options}: {done.stderr.strip()}", flush=True)
        where.rmdir()
        return None
    return where


def write_round(directory: Path, shards: int, samples: int, state: torch.Tensor) -> tuple[float, int]:
    """GB/s of `shards` shards written at once, one thread each, and the huge pages they held."""
    paths = [directory / f"shard-{i}.safetensors" for i in range(shards)]
    threads = [threading.Thread(target=write_shard, args=(path, samples, state)) for path in paths]
    before = shmem_huge_bytes()
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    huge = shmem_huge_bytes() - before
    written = sum(path.stat().st_size for path in paths)
    for path in paths:
        path.unlink()
    return written / seconds / 1e9, huge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="samples of 2,048 tokens a shard (8: 0.94 GB)")
    parser.add_argument("--shards", default="1,4", help="shards written at once, one thread each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-gb", type=float, default=16, help="each mounted tmpfs's size")
    args = parser.parse_args()
    targets = {"/dev/shm": Path(tempfile.mkdtemp(dir="/dev/shm", prefix="huge-tmpfs-check-"))}
    for options in ("huge=always", "huge=within_size"):
        if (where := mount(options, args.size_gb)) is not None:
            targets[options] = where
    state = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    shard_gb = args.samples * TOKENS * HIDDEN * 2 * STATES / 1e9
    try:
        for name, directory in targets.items():  # memory touched once: a microVM's RAM is slow to touch first
            write_round(directory, max(int(n) for n in args.shards.split(",")), args.samples, state)
        for shards in (int(n) for n in args.shards.split(",")):
            rates: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(args.rounds):
                for name, directory in targets.items():
                    rate, huge = write_round(directory, shards, args.samples, state)
                    rates[name].append(rate)
                    print(f"  {shards} shard(s) of {shard_gb:.2f} GB into {name}: {rate:.2f} GB/s, huge pages "
                          f"{huge / 1e9:.2f} GB", flush=True)
            base = sorted(rates["/dev/shm"])[len(rates["/dev/shm"]) // 2]
            for name, values in rates.items():
                median = sorted(values)[len(values) // 2]
                print(f"TMPFS {shards} shard(s) at once into {name}: {median:.2f} GB/s (median of {len(values)}), "
                      f"{median / base:.2f} x /dev/shm", flush=True)
    finally:
        targets.pop("/dev/shm").rmdir()
        for where in targets.values():
            subprocess.run(["umount", str(where)], check=False)
            where.rmdir()


if __name__ == "__main__":
    main()
