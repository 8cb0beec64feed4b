"""How well the codecs compress hidden states that training has shaped, against random-weight ones: the demo
model (its random weights, its tokenizer and chat template) is trained for a few hundred steps on real
conversations, and the states of held-out conversations at the EAGLE-3 layers, in bf16 as a GPU run stores them,
go through `dataset.codec.Codec` before and after.

    python bench/codec_ratio.py --out work/codec-ratio --steps 300

Hugging Face's forward pass gives the states here (the capture's own equivalence to it is tested elsewhere); the
codec sees each layer's [T, H] tensor as the shard writer does. Prints the ratio per layer and overall, and the
training loss, so that one sees how far the model got from random.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from eagle_states.dataset.codec import Codec
from eagle_states.dataset.layout import LayerSelection
from eagle_states.demo import make_demo_model

CODECS = [Codec("blosc2-zstd"), Codec("blosc2-lz4")]


def conversations(path: Path, tokenizer, max_len: int) -> list[torch.Tensor]:
    rows = json.loads(Path(path).read_text())
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for row in rows:
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
        out.append(torch.tensor(ids[:max_len]))
    return out


def states_ratio(model, samples: list[torch.Tensor], layers: LayerSelection) -> dict:
    """Per layer id and overall: captured bytes / stored bytes, each codec (bf16 states, one tensor per layer and
    sample, as the shard writer compresses them)."""
    raw = {k: 0 for k in layers.layer_ids}
    stored = {c.name: {k: 0 for k in layers.layer_ids} for c in CODECS}
    model.eval()
    with torch.no_grad():
        for ids in samples:
            out = model(ids[None], output_hidden_states=True)
            for k in layers.layer_ids:
                # layer id k < N: hidden_states[k]; k = N: the last layer's output before the final norm (HF gives
                # hidden_states[N] after the norm, so it is taken from a hook below)
                state = (out.hidden_states[k] if k < layers.num_layers else model._final_state)[0].bfloat16()
                raw[k] += state.nbytes
                for codec in CODECS:
                    stored[codec.name][k] += len(codec.encode([state], state.element_size()))
    return {name: {**{str(k): raw[k] / s[k] for k in s}, "all": sum(raw.values()) / sum(s.values())}
            for name, s in stored.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/sharegpt_dummy_conversation.json"))
    parser.add_argument("--out", type=Path, default=Path("work/codec-ratio"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--held-out", type=int, default=48)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_demo_model(args.out / "model", num_layers=args.layers, hidden_size=args.hidden,
                                num_heads=args.hidden // 64)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the final state before the norm, as the capture stores it for layer id N
    model.model.norm.register_forward_hook(lambda module, inputs, output: setattr(model, "_final_state", inputs[0]))
    layers = LayerSelection.resolve("eagle3", args.layers)
    samples = conversations(args.data, tokenizer, args.max_len)
    random.Random(0).shuffle(samples)
    held_out, train = samples[: args.held_out], samples[args.held_out:]
    result = {"model": {"hidden": args.hidden, "layers": args.layers}, "layer_ids": list(layers.layer_ids),
              "random_weights": states_ratio(model, held_out, layers)}
    torch.manual_seed(0)
    noise = torch.randn(4096, args.hidden).bfloat16()
    result["random_normal"] = {c.name: noise.nbytes / len(c.encode([noise], noise.element_size())) for c in CODECS}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    started, losses = time.time(), []
    for step in range(args.steps):
        batch = random.Random(step).sample(train, args.batch)
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, x in enumerate(batch):
            ids[i, : len(x)], labels[i, : len(x)] = x, x
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    result["training"] = {"steps": args.steps, "first_loss": losses[0], "last_loss": sum(losses[-10:]) / 10}
    result["trained_weights"] = states_ratio(model, held_out, layers)
    (args.out / "ratio.json").write_text(json.dumps(result, indent=2))
    for name in ("random_weights", "trained_weights"):
        for codec, ratios in result[name].items():
            print(f"{name:16s} {codec:12s} " + ", ".join(f"{k if k == 'all' else 'layer ' + k}: {v:.3f}"
                                                         for k, v in ratios.items()))
    print("random normal    " + ", ".join(f"{k}: {v:.3f}" for k, v in result["random_normal"].items()))


if __name__ == "__main__":
    main()
