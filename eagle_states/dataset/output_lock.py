"""One run at a time per dataset directory: an exclusive lock beside it, with a note of who holds it.

The lock is `filelock`'s (an flock on `.NAME.lock` next to the directory, outside it so that DVC never tracks
it): the kernel drops it when its process dies, however it dies, so a stale lock never blocks and is taken over
safely. The note beside it (`.NAME.lock.json`: host, pid, command, since when) is only for the message; the lock
file itself cannot carry it (a process that tries the lock truncates the file)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from eagle_states.dataset.files import atomic_write_json


class OutputBusy(RuntimeError):
    """The dataset directory is being written by another run."""


def lock_paths(out: Path) -> tuple[Path, Path]:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.lock", out.parent / f".{out.name}.lock.json"


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold `out` for this process (re-entrant in it: the flow and the stages it calls share the hold), or refuse
    at once naming the holder."""
    lock_file, note = lock_paths(out)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_file, timeout=0, thread_local=False, is_singleton=True)
    try:
        lock.acquire()
    except Timeout:
        raise OutputBusy(f"{out} is being written by another run ({_describe_holder(note)}); wait for it to "
                         "finish or stop it, or give this run another output directory") from None
    first = lock.lock_counter == 1
    try:
        if first:
            atomic_write_json(note, {"host": socket.gethostname(), "pid": os.getpid(),
                                     "command": " ".join(sys.argv), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
                              durable=False)
        yield
    finally:
        if first:
            note.unlink(missing_ok=True)
        lock.release()


def _describe_holder(note: Path) -> str:
    try:
        holder = json.loads(note.read_text())
    except (OSError, ValueError):
        return "holder unknown: it has only just started"
    return f"pid {holder['pid']} on {holder['host']} since {holder['since']}: {holder['command']}"
