"""What a flow run keeps in memory between its tasks: the one engine holder (`FlowEngines`: regeneration and the
shards share it) and the extraction plan with its shard stream (`Session`). Tasks receive their keys, strings, so
that nothing large passes through Prefect.

The engine is created by the first task that needs it, with the factory the flow was given, held under the
`gpu-engine` global concurrency limit when the server has one (one run per GPU at a time), and closed when the
flow run leaves `flow_engines`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from eagle_states import stages
from eagle_states.capture.engine import CaptureEngine, EngineSettings, RestartingEngines
from eagle_states.config import PipelineParams
from eagle_states.extraction.driver import Extraction
from eagle_states.extraction.stream import ShardStream

GPU_CONCURRENCY_LIMIT = "gpu-engine"
# The slot's lease: renewed in the background while the run lives, so a crashed run's slot frees within this.
GPU_SLOT_LEASE_S = 60.0
WAIT_NOTICE_S = 2.0  # a slot not had within this is waited for with a log line that says why
log = logging.getLogger("eagle_states.session")
_SESSIONS: dict[str, "Session"] = {}  # the flow run's sessions, by key: how its in-process tasks find them
_ENGINES: dict[str, "FlowEngines"] = {}  # likewise its engine holders


@dataclass
class FlowEngines:
    """A flow run's one engine holder, the GPU slot it holds once the engine is created, and the waits for it."""
    key: str
    holder: RestartingEngines
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    slot_wait_s: list[float] = field(default_factory=list)  # waits for the `gpu-engine` slot, where it exists


@dataclass
class Session:
    key: str
    extraction: Extraction
    engines: RestartingEngines
    stream: ShardStream

    @property
    def shard_names(self) -> list[str]:
        return [s.name for s in self.extraction.shards]

    def cache_key(self, shard_name: str) -> str:
        return self.extraction.cache_key(self.extraction.planned(shard_name))

    def intact(self, shard_name: str) -> bool:
        return self.extraction.receipt(self.extraction.planned(shard_name)) is not None


def gpu_slot_limit_exists() -> bool:
    """Whether the server has the `gpu-engine` limit: a user creates it to keep runs off each other's GPUs
    (README); without it nothing is acquired (and Prefect is not asked, which would warn on every run)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_CONCURRENCY_LIMIT)
        except ObjectNotFound:
            return False
    return True


def hold_gpu_slot(guard: contextlib.ExitStack) -> float | None:
    """Take a `gpu-engine` slot for the rest of `guard`, if the limit exists (else None); returns the seconds
    waited. A slot
    not free at once is waited for with a log line saying why; its lease (GPU_SLOT_LEASE_S) is renewed while this
    process lives, so a crashed run's slot frees within that time."""
    from prefect.concurrency.sync import concurrency

    if not gpu_slot_limit_exists():
        return None
    started = time.monotonic()
    try:
        guard.enter_context(concurrency(GPU_CONCURRENCY_LIMIT, occupy=1, timeout_seconds=WAIT_NOTICE_S,
                                        lease_duration=GPU_SLOT_LEASE_S))
    except TimeoutError:
        log.warning("waiting for a free '%s' slot: another run holds it (a crashed run's slot frees within %.0f s; "
                    "README: \"The GPU slot\")", GPU_CONCURRENCY_LIMIT, GPU_SLOT_LEASE_S)
        guard.enter_context(concurrency(GPU_CONCURRENCY_LIMIT, occupy=1, lease_duration=GPU_SLOT_LEASE_S))
        log.warning("got the '%s' slot after %.1f s", GPU_CONCURRENCY_LIMIT, time.monotonic() - started)
    return time.monotonic() - started


def _guarded(factory: Callable[[EngineSettings], CaptureEngine], guard: contextlib.ExitStack,
             waits: list[float], on_engine: Callable[[str], None]):
    def create(settings: EngineSettings) -> CaptureEngine:
        waited = hold_gpu_slot(guard)
        if waited is not None:
            waits.append(waited)
        on_engine("loading the model")
        started = time.monotonic()
        engine = factory(settings)
        log.info("model loaded in %.1f s: %s", time.monotonic() - started, settings.model)
        on_engine("shards on disk")
        return engine
    return create


@contextlib.contextmanager
def flow_engines(engine_factory: Callable[[EngineSettings], CaptureEngine],
                 on_engine: Callable[[str], None] = lambda state: None):
    """The flow run's engine holder, for every task that needs the model (no model is loaded until one does);
    `on_engine(state)` hears when the model starts loading and when it is loaded (the UI's progress)."""
    guard, waits = contextlib.ExitStack(), []
    engines = FlowEngines(uuid.uuid4().hex, RestartingEngines(_guarded(engine_factory, guard, waits, on_engine)),
                          guard, waits)
    _ENGINES[engines.key] = engines
    try:
        yield engines
    finally:
        _ENGINES.pop(engines.key, None)
        try:
            engines.holder.close()
        finally:
            guard.close()


@contextlib.contextmanager
def extraction_session(params: PipelineParams, engines: FlowEngines):
    """The extraction's plan and shard stream, on the flow run's engine holder."""
    extraction = stages.open_extraction(params)
    session = Session(uuid.uuid4().hex, extraction, engines.holder, ShardStream(extraction, engines.holder))
    _SESSIONS[session.key] = session
    try:
        yield session
    finally:
        _SESSIONS.pop(session.key, None)
        session.stream.close()


def get_session(key: str) -> Session:
    return _SESSIONS[key]


def get_engines(key: str) -> FlowEngines:
    return _ENGINES[key]
