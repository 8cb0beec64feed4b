"""How far the training target moves when the final slot is off by one: for each layer k, how often the target's
head on the state entering layer k (lm_head(norm(h_k)), the "logit lens") picks the token the model itself picks
(k = num_layers is the model's output), over the reply tokens of held-out demo conversations; HF forward, fp32.

    python bench/cpu-2026-12-02-final-layer/probe_lens.py TARGET [--conversations 40] [--seed 2]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_states.demo import demo_conversations
    from eagle_states.demo_training import TRAINING_FILE
    from eagle_states.prepare import renderer

    target = Path(args.target)
    recipe = json.loads((target / TRAINING_FILE).read_text()).get("recipe", "chat")
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    render, _ = renderer(tokenizer)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    agree, positions = None, 0
    with torch.no_grad():
        for row in demo_conversations(args.conversations, args.seed, recipe):
            ids, mask = render(tokenizer, [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]])
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            # predictions made at positions whose next token is a reply token
            where = torch.tensor(mask[1:] + [0], dtype=torch.bool)
            final = out.logits[0].argmax(-1)[where]
            lens = [model.lm_head(model.model.norm(h[0])).argmax(-1)[where] for h in out.hidden_states[:-1]]
            counts = torch.tensor([(p == final).sum().item() for p in lens] + [len(final)])
            agree = counts if agree is None else agree + counts
            positions += len(final)
    n = model.config.num_hidden_layers
    shares = {k: round(agree[k].item() / positions, 4) for k in range(n)}
    shares[n] = 1.0
    print(json.dumps({"target": str(target), "recipe": recipe, "positions": positions,
                      "argmax_agreement_with_the_output_by_layer": shares}))
