"""Engine workers that are still loading their model count as serving it: a worker announces itself on the Prefect
server (a variable `eagle-states-loading-<worker>`, refreshed every HEARTBEAT_S) from before its model loads until
the server lists its task worker, so that a run started meanwhile waits for it instead of loading a second copy
of the model beside it (out of GPU memory, or the load time again for nothing)."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)
PREFIX = "eagle-states-loading-"
HEARTBEAT_S = 5.0
STALE_S = 30.0  # an announcement not refreshed for this long is a worker that died while loading


def _variable_name(worker: str) -> str:
    return PREFIX + re.sub(r"[^a-z0-9_-]", "-", worker.lower())


class LoadingAnnouncement:
    """`worker` announced as loading `model` for `serving_key`, from `start()` until `end()` (refreshed every
    HEARTBEAT_S in between; a worker that dies goes stale after STALE_S)."""

    def __init__(self, worker: str, serving_key: str, model: str):
        self.name, self.record = _variable_name(worker), {"worker": worker, "serving_key": serving_key,
                                                          "model": model, "since": time.time()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="loading-announcement", daemon=True)

    def _announce(self) -> None:
        from prefect.variables import Variable

        Variable.set(self.name, {**self.record, "beat": time.time()}, overwrite=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._announce()
            except Exception as exc:  # the server away for a moment: the next beat tries again
                log.debug("could not refresh the loading announcement: %s", exc)

    def start(self) -> "LoadingAnnouncement":
        self._announce()
        self._thread.start()
        return self

    def end(self) -> None:
        from prefect.variables import Variable

        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):
            Variable.unset(self.name)


def loading_workers(serving_key: str) -> dict[str, dict]:
    """Workers announced as loading a model for `serving_key`, refreshed within STALE_S: worker -> announcement."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        variables = client.read_variables()
    now = time.time()
    return {v.value["worker"]: v.value for v in variables
            if v.name.startswith(PREFIX) and isinstance(v.value, dict)
            and v.value.get("serving_key") == serving_key and now - float(v.value.get("beat", 0)) < STALE_S}


def wait_for_loading(serving_key: str, serving: Callable[[str], set[str]], poll_s: float = 2.0) -> bool:
    """Whether engine workers serve `serving_key`, waiting for those still loading their model: True as soon as
    the server lists one, False when none serves and none is loading (any more)."""
    said = 0.0
    while True:
        if serving(serving_key):
            return True
        loading = loading_workers(serving_key)
        if not loading:
            return False
        if time.monotonic() - said > 30:
            said = time.monotonic()
            log.info("waiting for %s, loading %s (since %.0f s ago): a run here would load a second copy",
                     ", ".join(f"engine worker {w}" for w in sorted(loading)), next(iter(loading.values()))["model"],
                     time.time() - min(a["since"] for a in loading.values()))
        time.sleep(poll_s)
