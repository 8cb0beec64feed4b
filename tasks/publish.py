"""Publish task: only reached after validation passed; the push retries live in `publish` itself."""

from prefect import get_run_logger, task

from eagle_states import stages
from eagle_states.config import PipelineParams


@task(name="publish", task_run_name="publish", tags=["eagle-states", "publish"])
def publish_task(params: PipelineParams) -> stages.PublishOutcome:
    outcome = stages.publish(params)
    if params.publish.push and not outcome.pushed:
        get_run_logger().error(outcome.error)
    return outcome
