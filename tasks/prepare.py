"""Prepare task: conversations -> token ids and loss masks (skips itself when its output matches its inputs)."""

from prefect import task

from eagle_states.params import PipelineParams
from eagle_states.pipeline import prepare_step
from tasks.retry import transient_only


@task(name="prepare", retries=1, retry_delay_seconds=5, retry_condition_fn=transient_only)
def prepare_task(params: PipelineParams) -> dict:
    report = prepare_step(params, progress=False)
    return {k: report[k] for k in ("format", "rows_read", "rows_written", "rows_skipped", "skipped_by_reason",
                                   "num_tokens")}
