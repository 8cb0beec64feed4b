"""What a flow run keeps in memory between its tasks: its one engine (`FlowEngine`: regeneration and the shards
share its holder) and the extraction plan with its shard stream (`Session`). Tasks receive their handles, strings,
so that nothing large passes through Prefect.

The engine is created by the first task that needs it, with the factory the flow was given, held under the
`gpu-engine` global concurrency limit when the server has one (one run per GPU at a time), and closed when the
flow run leaves `open_flow_engine`.
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
# a handle is not a cache key: it only names an object of this process for the flow run's in-process tasks
_SESSIONS: dict[str, "Session"] = {}  # the flow run's sessions, by handle
_FLOW_ENGINES: dict[str, "FlowEngine"] = {}  # likewise its engine


@dataclass
class FlowEngine:
    """A flow run's one engine: its holder, the GPU slot it holds once the engine is created, and the waits for it."""
    handle: str
    holder: RestartingEngines
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    slot_wait_s: list[float] = field(default_factory=list)  # waits for the `gpu-engine` slot, where it exists


@dataclass
class Session:
    handle: str
    extraction: Extraction
    engines: RestartingEngines  # the flow engine's holder
    stream: ShardStream

    @property
    def shard_names(self) -> list[str]:
        return [s.name for s in self.extraction.shards]

    def shard_key(self, shard_name: str) -> str:
        return self.extraction.shard_key(self.extraction.planned(shard_name))

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
def open_flow_engine(engine_factory: Callable[[EngineSettings], CaptureEngine],
                 on_engine: Callable[[str], None] = lambda state: None):
    """The flow run's engine, for every task that needs the model (no model is loaded until one does);
    `on_engine(state)` hears when the model starts loading and when it is loaded (the UI's progress)."""
    guard, waits = contextlib.ExitStack(), []
    flow_engine = FlowEngine(uuid.uuid4().hex, RestartingEngines(_guarded(engine_factory, guard, waits, on_engine)),
                             guard, waits)
    _FLOW_ENGINES[flow_engine.handle] = flow_engine
    try:
        yield flow_engine
    finally:
        _FLOW_ENGINES.pop(flow_engine.handle, None)
        try:
            flow_engine.holder.close()
        finally:
            guard.close()


@contextlib.contextmanager
def extraction_session(params: PipelineParams, flow_engine: FlowEngine):
    """The extraction's plan and shard stream, on the flow run's engine."""
    extraction = stages.open_extraction(params)
    session = Session(uuid.uuid4().hex, extraction, flow_engine.holder, ShardStream(extraction, flow_engine.holder))
    _SESSIONS[session.handle] = session
    try:
        yield session
    finally:
        _SESSIONS.pop(session.handle, None)
        session.stream.close()


def get_session(handle: str) -> Session:
    return _SESSIONS[handle]


def get_flow_engine(handle: str) -> FlowEngine:
    return _FLOW_ENGINES[handle]
