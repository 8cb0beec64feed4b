"""Shards one at a time over one engine pass: what a Prefect task per shard calls."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagle_states.capture.engine import EngineHolder
from eagle_states.dataset.files import recorded_digest
from eagle_states.extraction.driver import Extraction

log = logging.getLogger(__name__)


@dataclass
class ShardOutcome:
    """What a shard task returns (and Prefect stores): small, paths and hashes only."""
    shard: str
    digest: str  # the shard file's, as its receipt records it
    bytes: int
    num_samples: int
    num_tokens: int
    computed: bool  # False when the shard was already on disk
    repaired: bool = False  # computed because its finished file was lost or changed
    worker: str = ""  # the engine worker that computed it (host-pid); empty in the flow run's own engine
    host: str = ""
    devices: str = ""
    seconds: float = 0.0  # on the worker: from the task's start to the shard's receipt


class ShardStream:
    """Shards one at a time for callers that ask for them in order (a Prefect task per shard), computed as one
    pass of the engine over the unfinished shards, so each shard's file is written while the next shard's
    forward passes run, as in `Extraction.run`. Asking for shard i computes as far as needed for shard i to be on
    disk (usually shard i+1 too); whatever else finishes meanwhile gets its receipt at once.

    The model is loaded (through `engines`) only if an asked-for shard is missing. When the pass fails before the
    asked shard is on disk, that shard is computed once more on its own: the failure may belong to a shard read
    ahead, and must then fail that shard's own task, not this one. The next call starts a new pass over the
    shards still unfinished.
    """

    def __init__(self, extraction: Extraction, engines: EngineHolder):
        self.extraction = extraction
        self.engines = engines
        self.computed: set[str] = set()  # shards this object wrote
        self._pass = None  # (the engine's result generator, suspended between calls; its shards by name)

    def ensure(self, shard_name: str) -> ShardOutcome:
        extraction = self.extraction
        shard = extraction.planned(shard_name)
        # a shard of the running pass is taken from the pass even if its file is already back on disk
        if self.pending(shard_name) or extraction.receipt(shard) is None:
            try:
                self._advance_pass_to(shard_name)
            except Exception:
                if extraction.receipt(shard) is not None:  # failed after this shard was on disk
                    raise
                log.warning("the engine pass failed before %s was on disk; computing it alone", shard_name,
                            exc_info=True)
                self._record(self.engines(extraction.engine_settings()).extract([extraction.job(shard)]),
                             {shard_name: shard})
        receipt = extraction.receipt(shard)
        if receipt is None:
            raise RuntimeError(f"shard {shard_name}: the engine pass ended without writing it")
        computed = shard_name in self.computed
        return ShardOutcome(shard.name, recorded_digest(receipt)[1], receipt["bytes"], len(receipt["samples"]),
                            sum(s["num_tokens"] for s in receipt["samples"]), computed,
                            computed and shard_name in extraction.damaged)

    def pending(self, shard_name: str) -> bool:
        """Part of the engine pass under way and not yet recorded."""
        return self._pass is not None and shard_name in self._pass[1] and shard_name not in self.computed

    def _advance_pass_to(self, shard_name: str) -> None:
        extraction = self.extraction
        if self._pass is None:
            extraction.begin()
            todo = {s.name: s for s in extraction.unfinished()}
            self._pass = (self.engines(extraction.engine_settings())
                          .extract([extraction.job(s) for s in todo.values()]), todo)
        results, todo = self._pass
        try:
            self._record(results, todo, until=shard_name)
            if self.computed >= todo.keys():  # every shard of the pass is on disk: let it end
                self._pass = None
                self._record(results, todo)
        except BaseException:
            self._pass = None
            results.close()  # no-op when the engine's pass failed (it reset itself)
            raise

    def _record(self, results, shards: dict, until: str | None = None) -> None:
        for result in results:
            self.extraction.record(shards[result.name], result)
            self.computed.add(result.name)
            if result.name == until:
                return

    def close(self) -> None:
        """Abandon an unfinished pass while the engine still runs: its requests are aborted, its writes waited for."""
        if self._pass is not None:
            results, self._pass = self._pass[0], None
            results.close()
