"""A trained demo target: the built-in demo model (`demo.make_demo_model`) trained briefly on the demo
conversations, so that it behaves predictably and a draft has something to learn (random weights give it
nothing: acceptance measured on them means nothing).

Seeded and deterministic (`torch.use_deterministic_algorithms`, one generator for the batches): the same
arguments give the same weights on the same machine (on CUDA, where attention's backward may warn that it has no
deterministic kernel and the matmuls run in TF32, two H200s recorded the same 200 losses for 2,000 steps). Plain
next-token loss on the conversations rendered with the chat template, AdamW with a cosine schedule; a few minutes
on two cores for the default 160 steps.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from eagle_states.training import optimizer_step

log = logging.getLogger(__name__)
TRAINING_FILE = "target_training.json"  # beside the weights: how the model was trained, its loss


def _messages(row: dict) -> list[dict]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]


def train_demo_model(out_dir: Path, *, steps: int = 160, seed: int = 0, conversations: int = 2000,
                     data_seed: int = 1, seq_len: int = 256, batch: int = 16, lr: float = 3e-3,
                     recipe: str = "chat", device: str = "cpu", **model_args) -> Path:
    """`make_demo_model(out_dir, seed=seed, **model_args)`, then `steps` steps of training on `conversations`
    demo conversations of `data_seed` and `recipe` (`demo.demo_conversations`; another seed than the held-out
    prompts the acceptance uses) on `device`, in fp32; saved in bf16 over the random weights, with TRAINING_FILE
    beside them."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from eagle_states.demo import demo_conversations, make_demo_model, save_bf16

    out_dir = Path(out_dir)
    started = time.monotonic()
    make_demo_model(out_dir, seed=seed, **model_args)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = [t for row in demo_conversations(conversations, data_seed, recipe)
           for t in tokenizer.apply_chat_template(_messages(row), tokenize=True, return_dict=False)]
    data = torch.tensor(ids, dtype=torch.long)
    blocks = data[: data.numel() // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)

    cuda = device.startswith("cuda")
    if cuda:  # cuBLAS is deterministic only with a fixed workspace; TF32 matmuls: a bigger target in minutes
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.set_float32_matmul_precision("high")
    # on CUDA a kernel without a deterministic version (attention's backward) warns instead of stopping the build
    torch.use_deterministic_algorithms(True, warn_only=cuda)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir),
                                             dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    batches = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        chosen = blocks[torch.randint(0, len(blocks), (batch,), generator=batches)].to(device)
        logits = model(input_ids=chosen[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chosen[:, 1:].flatten())
        losses.append(optimizer_step(model, optimizer, schedule, loss))
        if step % 40 == 0 or step == steps - 1:
            log.info("training the demo target: step %d/%d, loss %.3f", step + 1, steps, losses[-1])
    save_bf16(model, out_dir)
    (out_dir / TRAINING_FILE).write_text(json.dumps({
        "steps": steps, "seed": seed, "recipe": recipe, "device": device, "conversations": conversations,
        "data_seed": data_seed, "seq_len": seq_len,
        "batch": batch, "lr": lr, "tokens_seen": steps * batch * seq_len, "final_loss": losses[-1],
        "loss_every_10_steps": losses[::10], "seconds": round(time.monotonic() - started, 1)}, indent=2) + "\n")
    return out_dir
