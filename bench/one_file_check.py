"""One file written by several threads at once, at their own offsets: does a shard into tmpfs (one file, 0.94 GB at
the DeepSeek-V3 width) go faster written a sample's states at once than one state after another? Separate files
scale (bench/disk_check.py: 4 files into /dev/shm 3-4 x one on the H200 host); one file may not (the kernel's
per-file write lock). Through `pwrite`, the file's size allocated first or not, and copied into a shared mapping of
it (a mapping is written without the lock). Pieces of 29 MB, a state of a 2,048-token sample at hidden 7168 in
bf16.

    python3 bench/one_file_check.py DIR [GiB, default 1] [rounds, default 5]
"""

import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

PIECE = 2048 * 7168 * 2


def fresh(path: Path) -> int:
    path.unlink(missing_ok=True)
    return os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)


def write_pieces(fd: int, offsets: list[int], piece: memoryview, total: int) -> None:
    for offset in offsets:
        view = piece[:min(len(piece), total - offset)]
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def at_once(path: Path, total: int, piece: memoryview, threads: int, allocate_first: bool) -> tuple[float, float]:
    """Seconds for the whole file, and of them the fallocate's."""
    fd = fresh(path)
    try:
        started = time.perf_counter()
        if allocate_first:
            os.posix_fallocate(fd, 0, total)
        allocated = time.perf_counter() - started
        offsets = list(range(0, total, len(piece)))
        workers = [threading.Thread(target=write_pieces, args=(fd, offsets[i::threads], piece, total))
                   for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - started, allocated
    finally:
        os.close(fd)
        path.unlink()


def copy_pieces(dest, src, offsets: list[int]) -> None:
    for offset in offsets:
        n = min(len(src), len(dest) - offset)
        dest[offset:offset + n] = src[:n]


def mapped(path: Path, total: int, piece: memoryview, threads: int, allocate_first: bool, populate: bool) -> float:
    """Seconds for the whole file copied into a shared mapping of it by `threads` threads (no write call, so no
    per-file write lock; numpy's copy releases the GIL); its pages allocated first, and mapped at once."""
    import numpy as np

    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    try:
        started = time.perf_counter()
        os.ftruncate(fd, total)
        if allocate_first:
            os.posix_fallocate(fd, 0, total)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        with mmap.mmap(fd, total, flags=flags) as m:
            dest, src = np.frombuffer(m, np.uint8), np.frombuffer(piece, np.uint8)
            offsets = list(range(0, total, len(piece)))
            workers = [threading.Thread(target=copy_pieces, args=(dest, src, offsets[i::threads]))
                       for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            del dest  # the mapping closes only once nothing views it
        return time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()


def main():
    directory = Path(sys.argv[1])
    total = int(float(sys.argv[2] if len(sys.argv) > 2 else 1) * (1 << 30))
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    directory.mkdir(parents=True, exist_ok=True)
    piece = memoryview(os.urandom(PIECE))
    results: dict[str, list[float]] = {}
    for _ in range(rounds):  # interleaved, so that a change in the host's pace hits every method alike
        for threads in (1, 2, 4, 8):
            for allocate_first in (False, True):
                seconds, allocated = at_once(directory / "one-file", total, piece, threads, allocate_first)
                name = f"{threads} thread(s){', fallocate first' if allocate_first else ''}"
                results.setdefault(name, []).append(total / seconds / 1e9)
                if allocate_first:
                    results.setdefault(f"{threads} thread(s), the fallocate alone", []).append(total / allocated / 1e9)
            for allocate_first, populate in ((False, False), (True, False), (True, True)):
                name = (f"{threads} thread(s), mapped{', fallocate first' if allocate_first else ''}"
                        f"{', populated' if populate else ''}")
                seconds = mapped(directory / "one-file", total, piece, threads, allocate_first, populate)
                results.setdefault(name, []).append(total / seconds / 1e9)
    for name, rates in results.items():
        print(f"ONE FILE {name}: {statistics.median(rates):.2f} GB/s (median of {rounds}; "
              f"{min(rates):.2f}-{max(rates):.2f})")


if __name__ == "__main__":
    main()
