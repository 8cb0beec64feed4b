"""The coordinator's side of engine workers: submit the unfinished shards as shard tasks (`.delay()`: Prefect
queues them and hands each to whichever serving worker has a free slot), watch them, and submit again what a
dead or silent worker abandoned.

A shard is abandoned when its claim names a worker that the Prefect server no longer lists (its websocket
closed: seen within about a second of a SIGKILL, and counted after two polls in a row), or when the claim's
heartbeat is older than STALE_CLAIM_S (a hung worker). When a worker disappears, shards handed to it but not yet
started are lost with it (a task worker accepts its next run before it has a free slot), so every pending shard
that no live worker claims is submitted again; a copy that reaches a worker after the shard was finished finds
its receipt and returns at once. Receipts decide what is done, so nothing is counted twice or half."""

from __future__ import annotations

import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.coordination.claims import read_claim, regeneration_claim
from eagle_states.coordination.records import results_storage
from eagle_states.coordination.worker_tasks import (regeneration_task, shard_task, submitted_regeneration,
                                                    submitted_shard, task_key)
from eagle_states.dataset.layout import claim_path
from eagle_states.extraction.driver import CaptureConfig, Extraction
from eagle_states.extraction.stream import ShardOutcome

log = logging.getLogger("eagle_states.dispatch")
POLL_S = 0.5
SUBMIT_THREADS = 4
STALE_CLAIM_S = 30.0
NO_WORKER_S = 120.0  # how long pending shards wait with no worker serving them before the run gives up


class NoEngineWorker(RuntimeError):
    pass


def serving_workers(serving_key: str, client=None) -> set[str]:
    """Task workers the Prefect server lists for this engine kind (in ephemeral mode: the temporary server's);
    `client`: an open sync client to ask through (else one is opened)."""
    from prefect.client.orchestration import get_client

    if client is None:
        with get_client(sync_client=True) as client:
            return serving_workers(serving_key, client)
    response = client.request("POST", "/task_workers/filter",
                              json={"task_worker_filter": {"task_keys": [task_key(serving_key)]}})
    response.raise_for_status()
    return {worker["identifier"] for worker in response.json()}


def dispatch(extraction: Extraction, params: PipelineParams, on_done=None) -> list[ShardOutcome]:
    """Compute every unfinished shard on the engine workers; returns the outcomes of the shards computed or found
    finished by them (in shard order). `on_done(outcome)` is called as each one completes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
    from prefect.states import Crashed

    task = shard_task(submitted_shard, extraction.serving_key, results_storage(params.output.prefect_results))
    request = params.model_dump(mode="json", by_alias=True)
    todo = {s.name: s for s in extraction.unfinished()}
    extraction.begin()

    def submit(name: str):
        return task.delay(request, name, extraction.shard_key(todo[name]))  # a PrefectDistributedFuture

    # submitted from a few threads, so that the round trips of one submission (the server, the parameters' file)
    # overlap the next ones; each in a copy of this thread's context, so that its task run belongs to the flow run
    contexts = [contextvars.copy_context() for _ in todo]
    with ThreadPoolExecutor(max_workers=SUBMIT_THREADS, thread_name_prefix="eagle-submit") as pool:
        pending = dict(zip(todo, pool.map(lambda ctx, name: ctx.run(submit, name), contexts, todo)))
    log.info("%d shards submitted to the engine workers (task key %s)", len(pending), task.task_key)
    outcomes: dict[str, ShardOutcome] = {}
    seen, missing, no_worker_since = set(), set(), None  # workers listed so far; absent at the last poll
    with get_client(sync_client=True) as client:
        while pending:
            time.sleep(POLL_S)
            runs = {run.id: run for run in client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(
                any_=[f.task_run_id for f in pending.values()])), limit=len(pending))}
            for name, future in list(pending.items()):
                run = runs.get(future.task_run_id)
                if run is None or run.state is None:
                    continue
                if run.state.is_completed():
                    outcome = ShardOutcome(**future.result())
                    outcomes[name] = outcome
                    del pending[name]
                    if on_done:
                        on_done(outcome)
                elif run.state.is_failed() or run.state.is_crashed():
                    future.result()  # raises the shard's error (the worker already retried it)
            alive = serving_workers(extraction.serving_key, client)
            # only a running shard task can hold a claim: the files of the few running ones are read, not all
            claims = {name: read_claim(claim_path(extraction.out, name)) if (run := runs.get(future.task_run_id))
                      and run.state and run.state.is_running() else None for name, future in pending.items()}
            absent = (seen | {c[0]["worker"] for c in claims.values() if c}) - alive
            gone, missing = absent & missing, absent  # absent twice in a row: gone
            seen = (seen | alive) - gone
            no_worker_since = None if alive else (no_worker_since or time.monotonic())
            if pending and no_worker_since and time.monotonic() - no_worker_since > NO_WORKER_S:
                raise NoEngineWorker(f"no engine worker serves {params.model.path} (task key {task.task_key}) "
                                     f"and {len(pending)} shards are left: start one with `eagle-states "
                                     "engine-worker`")
            for name, future in list(pending.items()):
                claim = claims[name]
                if claim is None:
                    why = f"worker(s) {sorted(gone)} are gone and no live worker claims it" if gone else None
                elif claim[0]["worker"] in gone:
                    why = f"its worker {claim[0]['worker']} is gone"
                elif claim[1] > STALE_CLAIM_S:
                    why = f"its worker {claim[0]['worker']} has been silent for {claim[1]:.0f} s"
                else:
                    why = None
                if why is None:
                    continue
                log.warning("shard %s abandoned (%s): submitting it again", name, why)
                client.set_task_run_state(future.task_run_id, Crashed(message=f"abandoned: {why}"), force=True)
                claim_path(extraction.out, name).unlink(missing_ok=True)
                pending[name] = submit(name)
    return [outcomes[name] for name in sorted(outcomes)]


def regenerate_on_workers(params: PipelineParams) -> stages.RegenerateOutcome:
    """The run's regeneration as a task on an engine worker serving its model and settings (the engine its shards
    then use); submitted again when the worker doing it goes (its claim names a worker the server no longer lists,
    twice in a row, or has been silent STALE_CLAIM_S), or a worker goes while it waits to start."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    serving_key = CaptureConfig(params).serving_key
    task = regeneration_task(submitted_regeneration, serving_key, results_storage(params.output.prefect_results))
    request, claim = params.model_dump(mode="json", by_alias=True), regeneration_claim(params)
    future = task.delay(request)
    log.info("regeneration submitted to the engine workers (task key %s)", task.task_key)
    seen, missing, no_worker_since = set(), set(), None
    with get_client(sync_client=True) as client:
        while True:
            time.sleep(POLL_S)
            state = client.read_task_run(future.task_run_id).state
            if state is not None and state.is_completed():
                return stages.RegenerateOutcome(**future.result())
            if state is not None and (state.is_failed() or state.is_crashed()):
                future.result()  # raises the regeneration's error
            alive = serving_workers(serving_key, client)
            held = read_claim(claim) if state is not None and state.is_running() else None
            absent = (seen | ({held[0]["worker"]} if held else set())) - alive
            gone, missing = absent & missing, absent  # absent twice in a row: gone
            seen = (seen | alive) - gone
            no_worker_since = None if alive else (no_worker_since or time.monotonic())
            if no_worker_since and time.monotonic() - no_worker_since > NO_WORKER_S:
                raise NoEngineWorker(f"no engine worker serves {params.model.path} (task key {task.task_key}) to "
                                     "regenerate on: start one with `eagle-states engine-worker`")
            if held is None:
                why = f"worker(s) {sorted(gone)} are gone and no live worker claims it" if gone else None
            elif held[0]["worker"] in gone:
                why = f"its worker {held[0]['worker']} is gone"
            else:
                why = f"its worker {held[0]['worker']} has been silent for {held[1]:.0f} s" \
                    if held[1] > STALE_CLAIM_S else None
            if why is not None:
                log.warning("the regeneration was abandoned (%s): submitting it again", why)
                client.set_task_run_state(future.task_run_id, Crashed(message=f"abandoned: {why}"), force=True)
                claim.unlink(missing_ok=True)
                future = task.delay(request)
