"""Where a run's model work goes: decided here only (`placement`), once per run, by the command line's extract
and by the flow; the regeneration and the shards then follow that one answer."""

from __future__ import annotations

import contextlib
import enum
from typing import Callable

from eagle_states.config import PipelineParams
from eagle_states.coordination.dispatch import dispatch, serving_workers
from eagle_states.coordination.loading import wait_for_loading
from eagle_states.coordination.local_workers import local_engine_workers
from eagle_states.coordination.server import configured_api
from eagle_states.extraction.driver import CaptureConfig, Extraction
from eagle_states.extraction.stream import ShardOutcome


class Placement(enum.Enum):
    HERE = "an engine in this process"
    WORKERS = "the engine workers the Prefect server lists"
    LOCAL_WORKERS = "engine workers started on this machine for the run's shards"

    @property
    def regenerates_on_workers(self) -> bool:
        # local workers are started for the shards only: a regeneration runs in this process then
        return self is Placement.WORKERS


def placement(params: PipelineParams, serving_key: str | None = None) -> Placement:
    """On engine workers with `extract.data_parallel_size` > 1 (local ones, started for the run's shards) or
    `extract.engine: workers`; with `auto`, when a configured Prefect server lists a worker serving this model and
    these settings, or one still loading it (waited for: a run here would load a second copy); else in this
    process. `serving_key`: the run's, where already known (else worked out only if the server is asked)."""
    e = params.extract
    if e.data_parallel_size > 1:
        return Placement.LOCAL_WORKERS
    if e.engine == "workers":
        return Placement.WORKERS
    if e.engine == "auto" and configured_api() and \
            wait_for_loading(serving_key or CaptureConfig(params).serving_key, serving_workers):
        return Placement.WORKERS
    return Placement.HERE


def compute_on_workers(extraction: Extraction, where: Placement,
                       on_done: Callable[[ShardOutcome], None] | None = None) -> list[ShardOutcome]:
    """The unfinished shards on engine workers (`where` is not HERE): `extract.data_parallel_size` local ones
    started for this when there are any, else the ones the Prefect server lists (`dispatch`)."""
    params = extraction.params
    local = where is Placement.LOCAL_WORKERS and extraction.unfinished()
    with local_engine_workers(params, extraction.serving_key, params.extract.data_parallel_size) if local \
            else contextlib.nullcontext():
        return dispatch(extraction, params, on_done)


def shards_on_workers(extraction: Extraction) -> bool:
    """What the command line gives `stages.extract`: every unfinished shard computed on engine workers, True,
    where the placement says so; else nothing done, False (the stage computes them in this process)."""
    where = placement(extraction.params, extraction.serving_key)
    if where is Placement.HERE:
        return False
    compute_on_workers(extraction, where)
    return True
