"""Who computes a run's shards, over Prefect: the flow run's own engine (`session`) or engine workers (long-lived
processes holding a loaded model: `engine_worker`, `dispatch`, `local_workers`, `loading`), decided in one place
(`placement`). Above the stages (`eagle_states.stages` and below never import it: the command line and the flow
hand it to them), below the thin Prefect tasks (`tasks/`) and the flow (`flows/`)."""
