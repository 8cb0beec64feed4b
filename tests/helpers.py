"""What the tests share besides fixtures: paths, prompt files, parameters, the Hugging Face reference, and an
engine factory that counts the models it loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from eagle_states.capture.engine import CaptureEngine
from eagle_states.config import PipelineParams

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def random_prompts(lengths, vocab_size, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


def write_prompt_jsonl(path: Path, prompts, ids=None) -> Path:
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            row = {"id": ids[i] if ids else f"p{i:03d}", "input_ids": prompt,
                   "loss_mask": [int(j % 3 != 0) for j in range(len(prompt))]}
            f.write(json.dumps(row) + "\n")
    return path


def extraction_params(model: Path, source: Path, out: Path, **extract) -> PipelineParams:
    """Parameters for extracting `source` (a prompt JSONL or a prepared directory) with `model` into `out`;
    `extract` overrides the extract section (everything else is config's defaults)."""
    max_model_len = extract.get("max_model_len", 4096)
    return PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "prepare": {"max_length": min(2048, max_model_len - 1)},
        "extract": {"input": str(source), **extract}, "output": {"dir": str(out)}})


class CountingEngines:
    """An engine factory that counts the engines it creates (`engine_class`: the real engine or a subclass of it
    that injects a fault)."""

    def __init__(self, engine_class=CaptureEngine):
        self.engine_class = engine_class
        self.created = 0

    def __call__(self, settings):
        self.created += 1
        return self.engine_class(settings)


# -- the independent reference: Hugging Face transformers on the same weights ---------------------------------------
# Layer semantics as in eagle_states.dataset.layout: k < N is HF's hidden_states[k]; k = N is the input of the final
# norm (HF's last entry is after the norm).
def load_hf(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.no_grad()
def hf_states(model, input_ids: list[int], layer_ids: list[int]) -> list[torch.Tensor]:
    captured = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        out = model(torch.tensor([input_ids], device=model.device), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    return [(captured["pre_norm"] if k == n else out.hidden_states[k])[0].float() for k in layer_ids]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()
