"""The pipeline flow: prepare (or regenerate, on the engine the shards use) -> extract (a task per shard, on the
flow run's engine or on engine workers) -> validate -> export -> publish."""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from eagle_states import stopping
from eagle_states.capture.engine import CaptureEngine, EngineSettings
from eagle_states.config import PipelineParams, load_params
from eagle_states.coordination.placement import Placement, compute_on_workers, placement
from eagle_states.coordination.records import JsonRecordSerializer, keep_run_records_in, results_storage
from eagle_states.coordination.session import Session, extraction_session, open_flow_engine
from eagle_states.dataset.files import recorded_digest, sha256_file
from eagle_states.dataset.layout import MANIFEST_FILE
from eagle_states.dataset.output_lock import output_lock
from eagle_states.extraction.driver import kept_shards_line
from eagle_states.extraction.stream import ShardOutcome
from eagle_states.run_report import render_markdown
from eagle_states.stages import ensure_model
from tasks.export import export_task
from tasks.extract import extract_shard_task, finalize_dataset_task
from tasks.prepare import prepare_task
from tasks.publish import publish_task
from tasks.regenerate import regenerate_task
from tasks.validate import validate_task


def run_name() -> str:
    """A flow run is named after what it makes: the dataset directory and the model."""
    from prefect.runtime import flow_run

    params = _given(flow_run.parameters.get("params"), flow_run.parameters.get("params_file") or "params.yaml")
    return f"{Path(params.output.dir).name}-from-{Path(params.model.path).name}"


def _given(params: PipelineParams | dict | None, params_file: str) -> PipelineParams:
    if params is None:  # the default name may be absent (the defaults then); a file named otherwise must exist
        return load_params(None if params_file == "params.yaml" else params_file)
    if params_file != "params.yaml":
        raise ValueError(f"both the parameter form and params_file ({params_file}) were given; use one")
    return PipelineParams.model_validate(params) if isinstance(params, dict) else params


# the flow's result (a small dict) is stored as JSON, like every record this project lets Prefect keep
@flow(name="extract-hidden-states", log_prints=True, flow_run_name=run_name, persist_result=True,
      result_serializer=JsonRecordSerializer())
def extract_hidden_states(params: PipelineParams | None = None, params_file: str = "params.yaml") -> dict:
    """Extract EAGLE-3 training hidden states. Fill in the form (its defaults are params.yaml's) or leave it
    empty and name a parameters file in `params_file`; not both."""
    params = _given(params, params_file)
    keep_run_records_in(params.output.prefect_results)  # this run's records there, not in Prefect's default storage
    return pipeline(params, CaptureEngine)


def pipeline(params: PipelineParams, engine_factory: Callable[[EngineSettings], CaptureEngine]) -> dict:
    """The flow's body, with the engine factory its shard tasks use (a flow parameter cannot carry one)."""
    forward_library_logs()
    stopping.install()  # again: Prefect's flow engine has put its own SIGTERM handler in place
    stage_seconds: dict[str, float] = {}
    # the input this run writes (prepare.out or regenerate.out) is held too: another run sharing it would
    # otherwise replace it under this one
    written_input = nullcontext() if params.extract.input else output_lock(Path(params.extract_input))
    with output_lock(Path(params.output.dir)), written_input, \
            stopping.on_stop(callback=report_stopped, describe=lambda: kept_shards_line(params.output.dir)):
        progress = create_progress_artifact(0.0, key="extraction-progress", description="checking finished shards")
        ensure_model(params)  # the placement identifies the model (a deployment's run had no command line to build it)
        where = placement(params)  # once: the regeneration and the shards follow it
        prepared = regenerated = None
        with open_flow_engine(engine_factory, lambda state: update_progress_artifact(
                progress, 0.0, description=state)) as flow_engine:
            if params.regenerate.enabled:  # its output is the extraction's input; one engine for both
                with timed(stage_seconds, "regenerate"):
                    regenerated = regenerate_task(params, flow_engine.handle, where.regenerates_on_workers)
            else:
                with timed(stage_seconds, "prepare"):
                    prepared = prepare_task(params)
            with timed(stage_seconds, "extract"), extraction_session(params, flow_engine) as session:
                outcomes = compute_shards(session, where, progress)
                extracted = finalize_dataset_task(session.handle)
                lengths = [len(s.input_ids) for s in session.extraction.samples]
        if flow_engine.slot_wait_s:  # waiting for another run's GPU is not extraction (or regeneration) time
            stage_seconds["gpu_slot_wait"] = sum(flow_engine.slot_wait_s)
            loaded_in = "regenerate" if regenerated is not None and not regenerated.reused else "extract"
            stage_seconds[loaded_in] -= stage_seconds["gpu_slot_wait"]
        with timed(stage_seconds, "validate"):
            summary = validate_task(params)
        exports = [export_task(params, fmt) for fmt in params.export.formats]
        published = publish_task(params) if params.publish.enabled else None
    manifest_sha256 = sha256_file(Path(params.output.dir) / MANIFEST_FILE)
    report = render_markdown(dataset=params.output.dir, manifest=asdict(extracted), validation=summary,
                             outcomes=outcomes, stage_seconds=stage_seconds, lengths=lengths, model=params.model.path,
                             manifest_sha256=manifest_sha256)
    create_markdown_artifact(report, key="extraction-summary", description="samples, speed, cache hits, lengths")
    return {"dataset": params.output.dir, "model": params.model.path, "manifest_sha256": manifest_sha256,
            "prepare": asdict(prepared) if prepared else None,
            "regenerate": asdict(regenerated) if regenerated else None, "extract": asdict(extracted),
            "validation": summary,
            "validation_report": params.validate_.report,
            "exports": [asdict(e) for e in exports], "published": asdict(published) if published else None,
            "cache_hits": sum(not o.computed for o in outcomes), "computed": sum(o.computed for o in outcomes),
            "repaired": sum(o.repaired for o in outcomes), "computed_tokens": sum(o.num_tokens for o in outcomes
                                                                                  if o.computed),
            "stage_seconds": stage_seconds, "workers": sorted({o.worker for o in outcomes if o.computed and o.worker})}


def compute_shards(session: Session, where: Placement, progress) -> list[ShardOutcome]:
    """Every shard on disk: on engine workers when the run's placement says so (those the server lists, or local
    ones started for the run), else on the flow run's own engine."""
    extraction, logger, params = session.extraction, get_run_logger(), session.extraction.params
    if where is Placement.HERE:
        logger.info("the flow run computes the shards on its own engine (extract.engine: %s; no engine worker "
                    "serves %s with these settings)", params.extract.engine, params.model.path)
        return run_shards(session, params.output.prefect_results, progress)
    update_progress_artifact(progress, 0.0, description="shards on disk (engine workers)")
    done = [ShardOutcome(s.name, recorded_digest(r)[1], r["bytes"], len(r["samples"]),
                         sum(x["num_tokens"] for x in r["samples"]), False)
            for s in extraction.shards if (r := extraction.receipt(s)) is not None]

    def on_done(outcome: ShardOutcome):
        done.append(outcome)
        update_progress_artifact(progress, 100.0 * len(done) / len(extraction.shards))
    compute_on_workers(extraction, where, on_done)
    update_progress_artifact(progress, 100.0)
    outcomes = sorted(done, key=lambda o: o.shard)
    computed = sum(o.computed for o in outcomes)
    logger.info("%d shards: %d found finished, %d computed by engine workers", len(outcomes),
                len(outcomes) - computed, computed)
    return outcomes


def run_shards(session: Session, results_dir: str, progress) -> list[ShardOutcome]:
    """One task per shard, in order; a shard whose output is missing or altered refreshes its cache entry. The
    shards are computed as one engine pass (`ShardStream`), so a shard's file is written while the next runs."""
    from tqdm import tqdm

    storage = results_storage(results_dir)
    names = session.shard_names
    outcomes = []
    for name in tqdm(names, desc="extract", unit="shard"):
        # run the task (not its cached result) when the file is missing or this run has just written it
        refresh = not session.intact(name) or name in session.stream.computed or session.stream.pending(name)
        task = extract_shard_task.with_options(refresh_cache=refresh, result_storage=storage)
        state = task(session.handle, name, session.shard_key(name), return_state=True)
        outcome = state.result()
        # a cache hit returns the stored outcome of the run that computed it
        outcomes.append(replace(outcome, computed=False) if state.name == "Cached" else outcome)
        update_progress_artifact(progress, 100.0 * len(outcomes) / len(names))
    computed = sum(o.computed for o in outcomes)
    get_run_logger().info("%d shards: %d cache hits, %d computed (%d of them rewritten: lost or changed on disk)",
                          len(names), len(names) - computed, computed, sum(o.repaired for o in outcomes))
    return outcomes


def report_stopped(signum: int) -> None:
    """On a stop by signal (`eagle_states.stopping`): the flow run ends Cancelled when the runner was cancelling it
    (a cancel from the UI is a SIGTERM), Crashed otherwise."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.states import Cancelled, Crashed

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    name = signal.Signals(signum).name
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(context.flow_run.id).state
        state = Cancelled(message=f"cancelled ({name})") if current and current.name == "Cancelling" else \
            Crashed(message=f"stopped by {name}")
        client.set_flow_run_state(context.flow_run.id, state, force=True)


@contextmanager
def timed(stage_seconds: dict, name: str):
    started = time.time()
    try:
        yield
    finally:
        stage_seconds[name] = time.time() - started


def forward_library_logs() -> None:
    """vLLM's and this project's INFO logs into the flow-run logs (vLLM runs in this process). vLLM would set up
    its own logger when first imported, dropping the handler added here: it is told not to (before that import),
    and its records then also reach the terminal through the root logger."""
    import os

    from prefect.logging.handlers import APILogHandler

    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in ("vllm", "eagle_states"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)  # a deployment's flow-run process leaves the root logger at WARNING
        if not any(isinstance(h, APILogHandler) for h in logger.handlers):
            logger.addHandler(APILogHandler())
