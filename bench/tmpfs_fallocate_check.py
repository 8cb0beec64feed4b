"""Would allocating a shard's tmpfs pages before writing it make a shard's stream into RAM faster? One file
written in 64 MiB calls into a tmpfs folder, three ways side by side per round: written as it is; its whole size
allocated first (`posix_fallocate`, timed apart, then the writes); allocated 64 MiB ahead of the writes by
another thread. Prints the end-to-end GB/s of each (and the writes' alone for the second).

    python3 bench/tmpfs_fallocate_check.py [/dev/shm] [--gb 2] [--rounds 3]
"""

import argparse
import os
import threading
import time

import numpy as np

CHUNK = 64 << 20


def write_file(path: str, size: int, data: np.ndarray, mode: str) -> tuple[float, float]:
    """(seconds in all, seconds in the writes alone) for one file of `size` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    allocated, ready = [0], threading.Condition()

    def allocate_ahead():
        for offset in range(0, size, CHUNK):
            os.posix_fallocate(fd, offset, CHUNK)
            with ready:
                allocated[0] = offset + CHUNK
                ready.notify_all()

    try:
        started = time.perf_counter()
        helper = threading.Thread(target=allocate_ahead) if mode == "ahead" else None
        if helper:
            helper.start()
        if mode == "first":
            os.posix_fallocate(fd, 0, size)
        writes = time.perf_counter()
        offset = 0
        while offset < size:
            if helper:
                with ready:
                    ready.wait_for(lambda: allocated[0] >= offset + CHUNK)
            offset += os.pwrite(fd, data, offset)
        if helper:
            helper.join()
        ended = time.perf_counter()
        return ended - started, ended - writes
    finally:
        os.close(fd)
        os.unlink(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default="/dev/shm")
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gb * 2**30) // CHUNK * CHUNK
    data = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    path = os.path.join(args.folder, f"fallocate-check-{os.getpid()}.bin")
    write_file(path, size, data, "plain")  # first touch of the memory, not counted
    for round_ in range(args.rounds):
        line = []
        for mode in ("plain", "first", "ahead"):
            total, writes = write_file(path, size, data, mode)
            line.append(f"{mode} {size / total / 1e9:.2f} GB/s"
                        + (f" (the writes alone {size / writes / 1e9:.2f})" if mode == "first" else ""))
        print(f"FALLOCATE round {round_}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
