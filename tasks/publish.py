"""Publish task: only reached after validation passed; the push retries live in `publish` itself."""

from pathlib import Path

from prefect import get_run_logger, task

from eagle_states.params import PipelineParams
from eagle_states.publish import publish


@task(name="publish")
def publish_task(params: PipelineParams) -> dict:
    result = publish(Path("."), Path(params.output.dir), Path(params.validate_.report), push=params.publish.push,
                     push_retries=params.publish.push_retries)
    if params.publish.push and not result["pushed"]:
        get_run_logger().error(result["error"])
    return result
