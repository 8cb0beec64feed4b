"""The pipeline's steps as plain functions of `PipelineParams`: what the Prefect tasks, the DVC stages and the CLI
call. Nothing here imports Prefect."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eagle_states import contract
from eagle_states.engine import CaptureEngine, EngineHolder
from eagle_states.extract import Extraction, PlannedShard
from eagle_states.params import PipelineParams
from eagle_states.prepare import REPORT_FILE as PREPARE_REPORT
from eagle_states.prepare import SAMPLES_FILE, PrepareSettings, prepare

log = logging.getLogger(__name__)


def ensure_inputs(params: PipelineParams) -> None:
    """Build the built-in demo model and conversations where the parameters ask for them and they are missing."""
    from eagle_states.demo_model import make_demo_model, write_demo_conversations

    if not (Path(params.model.path) / "config.json").exists():
        if not params.model.build_demo_if_missing:
            raise FileNotFoundError(f"model directory {params.model.path} has no config.json")
        make_demo_model(Path(params.model.path))
    if not Path(params.data.path).exists():
        if not params.data.build_demo_if_missing:
            raise FileNotFoundError(f"data file {params.data.path} does not exist")
        write_demo_conversations(Path(params.data.path))


def record_inputs(params: PipelineParams, out: Path) -> dict:
    """The identity of the model and the data, as a small file DVC stages depend on (hashing a model directory
    of a trillion parameters on every `dvc repro` is not an option; its fingerprint is)."""
    ensure_inputs(params)
    identity = {"model": {k: v for k, v in contract.model_identity(Path(params.model.path)).items() if k != "path"},
                "data_sha256": contract.sha256_file(Path(params.data.path))}
    if not out.exists() or json.loads(out.read_text()) != identity:  # unchanged bytes keep DVC from rerunning
        contract.atomic_write_json(out, identity)
    return identity


def prepare_settings(params: PipelineParams) -> PrepareSettings:
    p = params.prepare
    return PrepareSettings(max_length=p.max_length, overlong=p.overlong, min_loss_tokens=p.min_loss_tokens,
                           limit=p.limit, shuffle_seed=p.shuffle_seed, dedup=p.dedup, format=params.data.format)


def prepare_identity(params: PipelineParams) -> str:
    """What decides the prepared output: the data bytes, the tokenizer and template, the settings, the code."""
    model = contract.model_identity(Path(params.model.path))
    code = contract.hash_files([Path(__file__).parent / "prepare.py"])
    return contract.hash_json({"data": contract.sha256_file(Path(params.data.path)),
                               "tokenizer": model["tokenizer_sha256"], "settings": prepare_settings(params).__dict__,
                               "code": code})


def prepared_intact(params: PipelineParams) -> dict | None:
    """The prepare report if the prepared output on disk was made from these inputs, else None."""
    out = Path(params.prepare.out)
    report_path = out / PREPARE_REPORT
    if not report_path.exists() or not (out / SAMPLES_FILE).exists():
        return None
    report = json.loads(report_path.read_text())
    if report.get("identity") != prepare_identity(params):
        return None
    if report.get("samples_sha256") != contract.sha256_file(out / SAMPLES_FILE):
        return None
    return report


def prepare_step(params: PipelineParams, progress: bool = True) -> dict:
    """Prepare unless the prepared output already matches these inputs; returns the report."""
    ensure_inputs(params)
    existing = prepared_intact(params)
    if existing is not None:
        return existing
    return prepare(Path(params.data.path), Path(params.model.path), Path(params.prepare.out),
                   prepare_settings(params), progress=progress, identity=prepare_identity(params))


def extraction_settings(params: PipelineParams):
    from eagle_states.extract import ExtractionSettings

    e = params.extract
    return ExtractionSettings(
        model=Path(params.model.path), layer_ids=e.layer_ids, dtype=e.dtype, shard_max_tokens=e.shard_max_tokens,
        max_model_len=e.max_model_len, max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
        gpu_memory_utilization=e.gpu_memory_utilization, tensor_parallel_size=e.tensor_parallel_size,
        write_threads=e.write_threads)


def open_extraction(params: PipelineParams) -> Extraction:
    return Extraction(extraction_settings(params), Path(params.extract_input), Path(params.output.dir))


def shard_cache_key(extraction: Extraction, shard: PlannedShard) -> str:
    """What decides a shard's bytes: its samples' content, the model identity, layer ids, dtype and capture code
    (all inside the extraction's config hash). No run id, no path."""
    return contract.hash_json({"shard": shard.name, "content": shard.content_hash, "config": extraction.config_hash})


@dataclass
class ShardOutcome:
    """What a shard task returns (and Prefect stores): small, paths and hashes only."""
    shard: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    computed: bool  # False when the shard was already on disk


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
        if extraction.receipt(shard) is None:
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
        return ShardOutcome(shard.name, receipt["sha256"], receipt["bytes"], len(receipt["samples"]),
                            sum(s["num_tokens"] for s in receipt["samples"]), shard_name in self.computed)

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


class RestartingEngines(EngineHolder):
    """The engine holder a flow run owns: every shard and retry shares one engine; a dead one is restarted once."""

    def __init__(self, factory=CaptureEngine, restarts: int = 1):
        super().__init__(factory)
        self.restarts_left = restarts

    def restart_if_dead(self, error: BaseException) -> bool:
        """True if the engine was dead and was dropped, so that the next attempt loads a fresh one."""
        if self.engine is None or self.restarts_left <= 0 or not engine_is_dead(self.engine, error):
            return False
        self.restarts_left -= 1
        try:
            self.close()
        except Exception:  # a dead engine may fail to shut down; it is dropped either way
            self.engine = None
        return True


def engine_is_dead(engine: CaptureEngine, error: BaseException) -> bool:
    """Whether the engine can still serve: vLLM says it is dead, or a one-token request through it fails."""
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(error, EngineDeadError):
        return True
    try:
        engine.llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), use_tqdm=False)
        engine._rpc("eagle_poll", False)
        return False
    except Exception:
        return True
