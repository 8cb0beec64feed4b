"""What a flow run keeps in memory between its shard tasks: the extraction plan, the shard stream and the one
engine holder (tasks receive the session key, a string, so that nothing large passes through Prefect).

The engine is created by the first task that needs it, with the factory the flow was given, held under the
`gpu-engine` global concurrency limit (one run per GPU at a time), and closed when the flow run leaves the
session.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Callable

from eagle_states import stages
from eagle_states.capture.engine import CaptureEngine, EngineSettings, RestartingEngines
from eagle_states.config import PipelineParams
from eagle_states.extraction.driver import Extraction
from eagle_states.extraction.stream import ShardStream

GPU_CONCURRENCY_LIMIT = "gpu-engine"
_SESSIONS: dict[str, "Session"] = {}  # the flow run's sessions, by key: how its in-process tasks find them


@dataclass
class Session:
    key: str
    extraction: Extraction
    engines: RestartingEngines
    stream: ShardStream
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def shard_names(self) -> list[str]:
        return [s.name for s in self.extraction.shards]

    def cache_key(self, shard_name: str) -> str:
        return self.extraction.cache_key(self.extraction.planned(shard_name))

    def intact(self, shard_name: str) -> bool:
        return self.extraction.receipt(self.extraction.planned(shard_name)) is not None


def _guarded(factory: Callable[[EngineSettings], CaptureEngine], guard: contextlib.ExitStack):
    def create(settings: EngineSettings) -> CaptureEngine:
        from prefect.concurrency.sync import concurrency

        guard.enter_context(concurrency(GPU_CONCURRENCY_LIMIT, occupy=1, strict=False))
        return factory(settings)
    return create


@contextlib.contextmanager
def extraction_session(params: PipelineParams, engine_factory: Callable[[EngineSettings], CaptureEngine]):
    guard = contextlib.ExitStack()
    extraction = stages.open_extraction(params)
    engines = RestartingEngines(_guarded(engine_factory, guard))
    session = Session(uuid.uuid4().hex, extraction, engines, ShardStream(extraction, engines), guard)
    _SESSIONS[session.key] = session
    try:
        yield session
    finally:
        _SESSIONS.pop(session.key, None)
        try:
            session.stream.close()
            session.engines.close()
        finally:
            guard.close()


def get_session(key: str) -> Session:
    return _SESSIONS[key]
