"""Regenerate task: the assistant turns replaced by the target model's replies, on the engine the run's shards
use: the flow run's own, or an engine worker's when workers serve this model and these settings (then the flow
run loads nothing). Progress in the UI; skips itself when its output matches its inputs."""

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.coordination.dispatch import regenerate_on_workers
from eagle_states.coordination.retry import transient_only
from eagle_states.coordination.session import get_flow_engine


@task(name="regenerate", task_run_name="regenerate", tags=["eagle-states", "regenerate"], retries=1,
      retry_delay_seconds=5, retry_condition_fn=transient_only)
def regenerate_task(params: PipelineParams, flow_engine: str, on_workers: bool) -> stages.RegenerateOutcome:
    """`flow_engine`: the flow run's `FlowEngine` handle; `on_workers`: the run's placement says engine workers
    regenerate (`coordination.placement`)."""
    if on_workers:
        return regenerate_on_workers(params)
    engines = get_flow_engine(flow_engine).holder
    progress = create_progress_artifact(0.0, key="regeneration-progress", description="conversations regenerated")
    shown = [0.0]

    def on_progress(done: int, total: int):
        percent = 100.0 * done / total
        if percent >= shown[0] + 1 or done == total and percent > shown[0]:  # a call per percent, not per reply
            shown[0] = percent
            update_progress_artifact(progress, percent)
    try:
        return stages.regenerate(params, engines=engines, on_progress=on_progress)
    except Exception as exc:
        engines.restart_if_dead(exc)  # a dead engine is replaced before the retry
        raise
