"""Prepare task: conversations -> token ids and loss masks (skips itself when its output matches its inputs)."""

from prefect import task

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.coordination.retry import transient_only


@task(name="prepare", task_run_name="prepare", tags=["eagle-states", "prepare"], retries=1, retry_delay_seconds=5,
      retry_condition_fn=transient_only)
def prepare_task(params: PipelineParams) -> stages.PrepareOutcome:
    return stages.prepare(params)
