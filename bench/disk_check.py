"""The device disk's write bandwidth by method, each with 1 and 4 files in parallel: through
`dataset.files.atomic_file`, buffered and streamed to the disk as it goes (how small files are written) and as
shards are written (O_DIRECT, page cache bypassed, except on a filesystem in memory); and through `DirectFile` in
any case (`o_direct`: what shards into /dev/shm were written with before 2026-12-03).

    python3 bench/disk_check.py DIR [GiB per method, default 8]
"""

import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_states.bench import write_like_a_shard  # noqa: E402
from eagle_states.dataset.files import DirectFile  # noqa: E402

BLOCK = 64 << 20


def write_o_direct(path: Path, total_bytes: int, block) -> None:
    """As `write_like_a_shard` through DirectFile whatever the filesystem (no temp name, no rename)."""
    path.touch()
    out = DirectFile.open(path)
    if out is None:
        raise OSError(f"{path}: O_DIRECT refused")
    try:
        for _ in range(total_bytes // len(block)):
            out.write(block)
        out.finish()
        os.fsync(out.fd)
    finally:
        out.close()


def measure(method, directory: Path, total: int, streams: int) -> float:
    buffers = [os.urandom(BLOCK) for _ in range(streams)]
    threads = [threading.Thread(target=method, args=(directory / f"probe-{i}", total // streams, buffers[i]))
               for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    for i in range(streams):
        (directory / f"probe-{i}").unlink()
    return total / elapsed / 1e9


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    total = int(float(sys.argv[2] if len(sys.argv) > 2 else 8) * 2**30)
    methods = {"buffered": functools.partial(write_like_a_shard, direct=False), "shard": write_like_a_shard,
               "o_direct": write_o_direct}
    for name in ("buffered", "shard", "o_direct", "buffered", "shard", "o_direct"):
        for streams in (1, 4):
            print(f"DISK {name:8s} {streams} stream(s): {measure(methods[name], directory, total, streams):.2f} GB/s",
                  flush=True)
