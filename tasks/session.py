"""What a flow run keeps in memory between its tasks: the extraction plan and the one engine holder.

Tasks receive only the session key (a string), so that nothing large is passed through Prefect; the engine is
created by the first task that needs it, held under the `gpu-engine` global concurrency limit (one run per GPU
at a time), and closed when the flow run leaves the session.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field

from eagle_states.engine import CaptureEngine
from eagle_states.extract import Extraction
from eagle_states.params import PipelineParams
from eagle_states.pipeline import RestartingEngines, ShardStream, open_extraction, shard_cache_key

GPU_CONCURRENCY_LIMIT = "gpu-engine"
ENGINE_FACTORY = CaptureEngine  # the engine class; tests substitute a subclass that injects a fault
_SESSIONS: dict[str, "Session"] = {}


@dataclass
class Session:
    key: str
    extraction: Extraction
    engines: RestartingEngines
    stream: ShardStream
    results_dir: str
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def shard_names(self) -> list[str]:
        return [s.name for s in self.extraction.shards]

    def cache_key(self, shard_name: str) -> str:
        return shard_cache_key(self.extraction, self.extraction.planned(shard_name))

    def intact(self, shard_name: str) -> bool:
        return self.extraction.receipt(self.extraction.planned(shard_name)) is not None


def _guarded_factory(guard: contextlib.ExitStack):
    def create(settings):
        from prefect.concurrency.sync import concurrency

        guard.enter_context(concurrency(GPU_CONCURRENCY_LIMIT, occupy=1, strict=False))
        return ENGINE_FACTORY(settings)
    return create


@contextlib.contextmanager
def extraction_session(params: PipelineParams):
    guard = contextlib.ExitStack()
    extraction, engines = open_extraction(params), RestartingEngines(_guarded_factory(guard))
    session = Session(uuid.uuid4().hex, extraction, engines, ShardStream(extraction, engines),
                      params.output.prefect_results, guard)
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
