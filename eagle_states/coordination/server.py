"""The Prefect server a run records itself on: the one `PREFECT_API_URL` names, else a temporary one on this
machine, as Prefect's ephemeral mode makes it (the same server, on a free port, without its UI), but started as
the command begins, so that its start (5-9 s on a 2-core machine: most of a cached rerun when Prefect starts it at
the flow's call) overlaps the command's imports and input checks; stopped when the run ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

PORT_IN_USE = 3  # uvicorn's exit status when its port was taken meanwhile
_temporary_api: str | None = None  # the temporary server's API while a run is recorded on it


class TemporaryServer:
    """A Prefect server process on 127.0.0.1, started at construction; `ready()` waits for its health check."""

    def __init__(self):
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        with contextlib.closing(socket.socket()) as probe:  # a free port, as the kernel picks one
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        # Prefect's own command for its ephemeral server (prefect.server.api.server.SubprocessASGIServer), which
        # would import that module here: seconds the command does not need
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app", "--host",
             "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1"})

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def ready(self, timeout_s: float) -> str:
        """The API's URL once the server answers its health check, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() == PORT_IN_USE:
                self.process = self._start()
            elif self.process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited ({self.process.returncode}) as it started")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self.api_url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the temporary Prefect server did not start in {timeout_s:.0f} s on this machine: start "
                           "one (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api, or raise "
                           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_temporary_server() -> TemporaryServer | None:
    """A temporary server, starting now, unless the environment names one (`PREFECT_API_URL`). Checked before
    Prefect is imported (a second, which the server's start overlaps too); a profile's URL is seen by `recorded_on`."""
    return None if os.environ.get("PREFECT_API_URL") else TemporaryServer()


@contextlib.contextmanager
def recorded_on(server: TemporaryServer | None):
    """Prefect pointed at `server` for the `with` block, once it answers; a configured server (a profile's
    PREFECT_API_URL) wins, and the temporary one is stopped. The caller stops `server` in the end either way."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if server is None or get_current_settings().api.url:
        if server is not None:
            server.stop()
        yield
        return
    global _temporary_api
    _temporary_api = server.ready(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")))
    with temporary_settings(updates={PREFECT_API_URL: _temporary_api}):
        try:
            yield
        finally:
            _drain_prefects_senders()
            _temporary_api = None


def configured_api() -> str | None:
    """The Prefect API a user configured (`PREFECT_API_URL`, a profile); None in Prefect's ephemeral mode and on
    the temporary server, where no engine worker can be listening."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return None if url == _temporary_api else url


def _drain_prefects_senders() -> None:
    """The flow run's last logs and events sent before the server stops (Prefect sends them from background
    threads, and would otherwise try at exit, to a server gone)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=5, at_exit=False)
