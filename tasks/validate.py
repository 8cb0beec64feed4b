"""Validate task: failures become a table artifact and are never retried; I/O errors are."""

from prefect import task
from prefect.artifacts import create_table_artifact

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.coordination.retry import transient_only
from eagle_states.validate import ValidationFailed


@task(name="validate", task_run_name="validate", tags=["eagle-states", "validate"], retries=2,
      retry_delay_seconds=[2, 10], retry_condition_fn=transient_only)
def validate_task(params: PipelineParams) -> dict:
    result = stages.validate(params)
    if not result.valid:
        create_table_artifact(key="validation-failures", table=result.failures.astype(str).to_dict("records"),
                              description=f"{len(result.failures)} validation failures in {params.output.dir}")
        raise ValidationFailed(result)
    return result.summary
