"""Export task: one trainer layout per call, after validation."""

from pathlib import Path

from prefect import task

from eagle_states.export import export_dataset
from eagle_states.params import PipelineParams
from tasks.retry import transient_only


@task(name="export", retries=1, retry_delay_seconds=5, retry_condition_fn=transient_only,
      task_run_name="export-{fmt}")
def export_task(params: PipelineParams, fmt: str) -> dict:
    return export_dataset(Path(params.output.dir), Path(params.export.out) / fmt, fmt, Path(params.validate_.report),
                          progress=False)
