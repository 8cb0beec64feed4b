"""One loaded engine fed by several callers at once: each caller (an engine worker's shard task, in its own
thread) hands over a shard and waits for its file; one thread drives the engine, so the next shard is admitted
while the current one finishes (`CaptureEngine.serve`) and the device does not idle between shards. Work that
needs the engine to itself (a regeneration: `run_exclusive`) runs on that thread between two shard passes.

This is the hand-over between threads of one process, not a work queue: which shards reach this engine is
decided by Prefect (the task worker takes a shard task when it has a free slot)."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from eagle_states.capture.engine import END, CaptureEngine
from eagle_states.capture.worker_calls import ShardJob, ShardResult

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Exclusive:
    """Work that drives the engine itself, run once the shards admitted before it are done."""
    work: Callable[[CaptureEngine], object]
    future: Future = field(default_factory=Future)


class EngineService:
    def __init__(self, engine: CaptureEngine):
        self.engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._waiting: dict[str, Future] = {}  # shard file -> its callers' future, until the file is on disk
        self._lock = threading.Lock()
        self._closed = False
        self._exclusive: _Exclusive | None = None  # taken from the queue; runs when the shard pass has ended
        self._thread = threading.Thread(target=self._drive, name="eagle-engine", daemon=True)
        self._thread.start()

    def compute(self, job: ShardJob) -> ShardResult:
        """Hand a shard to the engine and wait until its file is on disk (raises what the engine raised). A shard
        already in this engine (a copy of its task, submitted again) waits for the same file."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine service is closed")
            future = self._waiting.get(str(job.path))
            if future is None:
                future = self._waiting[str(job.path)] = Future()
                self._jobs.put(job)
        return future.result()

    def run_exclusive(self, work: Callable[[CaptureEngine], T]) -> T:
        """Run `work(engine)` on the engine's thread once the shards handed over before it are on disk (shards
        handed over after it wait); returns what it returns, raises what it raises."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine service is closed")
            item = _Exclusive(work)
            self._jobs.put(item)
        return item.future.result()

    def _next_job(self, wait: float | None):
        try:
            job = self._jobs.get(timeout=wait) if wait != 0 else self._jobs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(job, _Exclusive):  # the pass ends here (its shards finish first), then the work runs
            self._exclusive = job
            return END
        return job

    def _drive(self):
        """Run the engine over the shards handed over; after a failure, fail the shards it held and go on."""
        while True:
            try:
                for result in self.engine.serve(self._next_job):
                    with self._lock:
                        future = self._waiting.pop(str(result.path))
                    future.set_result(result)
                if self._exclusive is None:
                    return  # END: closed
                exclusive, self._exclusive = self._exclusive, None
                try:
                    exclusive.future.set_result(exclusive.work(self.engine))
                except BaseException as error:  # the work's own failure: the engine serves on
                    exclusive.future.set_exception(error)
            except BaseException as error:  # the engine reset itself; its shards are lost, later ones are not
                log.warning("the engine failed: %s", error)
                with self._lock:
                    failed, self._waiting = self._waiting, {}
                    queued = []
                    while not self._jobs.empty():
                        queued.append(self._jobs.get())
                if self._exclusive is not None:  # taken just before the failure: it runs on the reset engine
                    queued.insert(0, self._exclusive)
                    self._exclusive = None
                for job in queued:
                    if job is END or isinstance(job, _Exclusive):
                        self._jobs.put(job)
                    elif str(job.path) in failed:  # never admitted: it gets its chance on the reset engine
                        with self._lock:
                            self._waiting[str(job.path)] = failed.pop(str(job.path))
                        self._jobs.put(job)
                for future in failed.values():
                    future.set_exception(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.put(END)
        self._thread.join()
