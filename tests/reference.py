"""Independent reference: Hugging Face transformers on the same weights, with the layer semantics of
eagle_states.contract (k < N: hidden_states[k]; k = N: the input of the final norm, since HF's last entry is
after the norm)."""

import torch


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
