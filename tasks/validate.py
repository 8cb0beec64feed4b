"""Validate task: failures become a table artifact and are never retried; I/O errors are."""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from eagle_states.params import PipelineParams
from eagle_states.validate import ValidationFailed, validate_dataset
from tasks.retry import transient_only


@task(name="validate", retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=transient_only)
def validate_task(params: PipelineParams) -> dict:
    result = validate_dataset(Path(params.output.dir), Path(params.extract_input) if Path(params.extract_input).is_dir()
                              else None, min_loss_tokens=params.validate_.min_loss_tokens,
                              report=Path(params.validate_.report))
    if not result.valid:
        create_table_artifact(key="validation-failures", table=result.failures.astype(str).to_dict("records"),
                              description=f"{len(result.failures)} validation failures in {params.output.dir}")
        raise ValidationFailed(result)
    return result.summary
