"""A claim: a file naming the engine worker doing a piece of work (a shard beside its receipt, a regeneration beside
its output), touched every HEARTBEAT_S while it does. A coordinator that finds a claim of a worker the Prefect server
no longer lists, or one gone quiet, takes the work as abandoned and submits it again (`dispatch`)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from eagle_states.config import PipelineParams
from eagle_states.dataset.files import atomic_write_json

HEARTBEAT_S = 2.0  # a computing worker touches its claim this often


def worker_id() -> str:
    """As Prefect's task worker names itself (`TaskWorker.client_id`), so its liveness can be asked of the server."""
    return f"{socket.gethostname()}-{os.getpid()}"


def regeneration_claim(params: PipelineParams) -> Path:
    """The claim of the worker regenerating into `regenerate.out` (beside it: DVC tracks the folder)."""
    out = Path(params.regenerate.out).resolve()
    return out.parent / f".{out.name}.claim.json"


class Claim:
    """A file naming the worker computing a shard, touched every HEARTBEAT_S while it does; removed after."""

    def __init__(self, path: Path, devices: str):
        self.path, self.devices = path, devices
        self._stop = threading.Event()

    def __enter__(self):
        atomic_write_json(self.path, {"worker": worker_id(), "host": socket.gethostname(), "devices": self.devices,
                                      "since": time.time()}, durable=False)
        self._beat = threading.Thread(target=self._touch, daemon=True)
        self._beat.start()
        return self

    def _touch(self):
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # finalized under us: nothing left to claim
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._beat.join()
        self.path.unlink(missing_ok=True)


def read_claim(path: Path) -> tuple[dict, float] | None:
    """The claim and the seconds since its last heartbeat, or None."""
    try:
        return json.loads(path.read_text()), time.time() - path.stat().st_mtime
    except (FileNotFoundError, ValueError):
        return None
