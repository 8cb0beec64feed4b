"""Export task: one trainer layout per call, after validation."""

from prefect import task

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.coordination.retry import transient_only


@task(name="export", task_run_name="export-{fmt}", tags=["eagle-states", "export"], retries=1,
      retry_delay_seconds=5, retry_condition_fn=transient_only)
def export_task(params: PipelineParams, fmt: str) -> stages.ExportOutcome:
    return stages.export(params, fmt)
