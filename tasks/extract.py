"""Shard extraction task: cached by what decides the shard's bytes, retried without reloading the model."""

from __future__ import annotations

from prefect import task

from eagle_states import stages
from eagle_states.coordination.records import JsonRecordSerializer
from eagle_states.coordination.retry import transient_only
from eagle_states.coordination.session import get_session
from eagle_states.extraction.stream import ShardOutcome


def _cache_key(context, parameters) -> str:
    return parameters["shard_key"]  # content + model + byte-deciding settings + capture format: CaptureConfig.shard_key


@task(name="extract-shard", cache_key_fn=_cache_key, persist_result=True, result_serializer=JsonRecordSerializer(),
      retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=transient_only, task_run_name="extract-{shard_name}",
      tags=["eagle-states", "extract"])
def extract_shard_task(session: str, shard_name: str, shard_key: str) -> ShardOutcome:
    """`session`: the flow run's `Session` handle."""
    session = get_session(session)
    try:
        return session.stream.ensure(shard_name)
    except Exception as exc:
        session.engines.restart_if_dead(exc)  # a dead engine is replaced before the retry
        raise


@task(name="finalize-dataset", task_run_name="finalize-dataset", tags=["eagle-states", "extract"], retries=2,
      retry_delay_seconds=[2, 10], retry_condition_fn=transient_only)
def finalize_dataset_task(session: str) -> stages.ExtractOutcome:
    return stages.finalize(get_session(session).extraction)
