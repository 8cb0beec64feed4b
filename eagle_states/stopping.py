"""Stopping on Ctrl-C (SIGINT) or SIGTERM within seconds, at any stage, with nothing written after the signal.

Letting `KeyboardInterrupt` unwind does not stop a run: it lands in whichever frame the main thread is in
(vLLM's step loop, a Prefect task's retry logic, a writer's wait), writer threads outlive it, and a run was seen
computing and committing shards for three minutes after Ctrl-C. So the handler does the stopping itself:

1. it freezes the output: `committing()` guards every rename of a finished file (`files.atomic_file`), and once
   the handler holds that lock no file is committed any more;
2. it removes the temporary files of writes in flight, and no new one is made (`temp_file`);
3. it runs the stop callbacks, bounded in time (giving back the `gpu-engine` slot, telling the Prefect server
   how the flow run ended);
4. it stops every child process (tensor-parallel workers, local engine workers, the temporary Prefect server,
   DVC and git), asking first and killing what is left after a grace period;
5. it prints one line: what was kept and how to resume, and exits with 128 + the signal number (130, 143).

A process exit frees what the engine held (GPU memory, the in-process engine core), so no orderly engine
shutdown is waited for: on a model of hundreds of GB that alone takes longer than "within seconds".
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

CALLBACK_SECONDS = 3.0  # stop callbacks talk to a server that may be gone already
CHILD_GRACE_SECONDS = 3.0


class Stopping(RuntimeError):
    """A commit refused because the process is stopping on a signal."""


_commit_lock = threading.RLock()
_frozen = False
_temp_files: set[str] = set()
_callbacks: list[Callable[[int], None]] = []
_describers: list[Callable[[], str]] = []


@contextmanager
def committing() -> Iterator[None]:
    """Around the step that makes a file final (a rename), or a temp file: refused once a stop has begun."""
    with _commit_lock:
        if _frozen:
            raise Stopping("stopping on a signal: nothing more is committed")
        yield


def temp_file(directory: str, prefix: str, suffix: str, readable: bool = False) -> tuple[int, str]:
    """A new file (fd, path) at a random name, as `tempfile.mkstemp` makes one (opened write-only, or for reading
    too), tracked for removal by a stop
    (`untrack_temp` once it is renamed or removed). Made under the commit lock and refused once a stop has begun: a
    writer thread that made one while the handler removed the tracked ones would leave it behind. Tracked before it
    exists: the handler may run in this very thread (the main one) between any two steps."""
    with committing():
        while True:
            path = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}{suffix}")
            _temp_files.add(path)
            try:
                mode = os.O_RDWR if readable else os.O_WRONLY
                return os.open(path, mode | os.O_CREAT | os.O_EXCL, 0o600), path
            except FileExistsError:
                _temp_files.discard(path)
            except BaseException:
                _temp_files.discard(path)
                raise


def untrack_temp(path: str) -> None:
    _temp_files.discard(path)


@contextmanager
def on_stop(callback: Callable[[int], None] | None = None, describe: Callable[[], str] | None = None):
    """While inside: `callback(signum)` runs when a stop begins (bounded by CALLBACK_SECONDS, for all of them),
    and `describe()` gives the line that says what was kept and how to resume."""
    entries = [(lst, fn) for lst, fn in ((_callbacks, callback), (_describers, describe)) if fn is not None]
    for lst, fn in entries:
        lst.append(fn)
    try:
        yield
    finally:
        for lst, fn in entries:
            lst.remove(fn)


def install() -> bool:
    """Handle SIGINT and SIGTERM this way from now on. Only the main thread can; returns whether it did. Call it
    again after a library installs its own handler (Prefect's flow engine replaces the SIGTERM handler)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _handle)
    return True


def _handle(signum: int, frame) -> None:
    global _frozen
    _commit_lock.acquire()  # waits for a rename in progress in another thread; never released: the process ends
    _frozen = True
    for path in list(_temp_files):
        try:
            os.unlink(path)
        except OSError:
            pass
    _run_bounded([lambda fn=fn: fn(signum) for fn in list(_callbacks)], CALLBACK_SECONDS)
    _stop_children()
    name = signal.Signals(signum).name
    lines = [f"stopped by {name}."]
    for describe in _describers:
        try:
            line = describe()
            if line not in lines:  # the command and the flow it runs may both describe the same output
                lines.append(line)
        except Exception as exc:  # a description that fails must not keep the process alive
            lines.append(f"(could not say what was kept: {exc})")
    sys.stdout.flush()
    sys.stderr.flush()
    # not print: a Prefect flow run turns prints into log records; a new line ends a progress bar's line
    os.write(2, ("\n" + " ".join(lines) + "\n").encode())
    os._exit(128 + signum)


def _run_bounded(calls: list[Callable[[], None]], seconds: float) -> None:
    def run_all():
        for call in calls:
            try:
                call()
            except Exception:
                pass
    thread = threading.Thread(target=run_all, daemon=True)
    thread.start()
    thread.join(seconds)


def _stop_children() -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=CHILD_GRACE_SECONDS)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=1)  # a kill takes effect once the process leaves the kernel (a driver call)
