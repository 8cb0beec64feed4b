"""A demo target trained with a recipe (built when missing): reply-token accuracy (greedy, 40 held-out
conversations of seed 2), cosine between the residual streams entering adjacent layers, their mean norms.

    python bench/cpu-2026-12-02-acceptance/probe_target.py DIR STEPS RECIPE [JSON of train_demo_model args]
"""
import sys, json, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eagle_states.demo_training import train_demo_model, _messages
from eagle_states.demo import demo_conversations
out = Path(sys.argv[1]); steps = int(sys.argv[2]); recipe = sys.argv[3]
kw = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
torch.set_num_threads(2)
t0 = time.time()
if not (out / "model.safetensors").exists():
    train_demo_model(out, steps=steps, recipe=recipe, **kw)
print("train s", round(time.time() - t0, 1), json.loads((out / "target_training.json").read_text())["loss_every_10_steps"])
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(out); model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
correct = total = 0; cos = {}; ccos = {}
hs_all = []
for row in demo_conversations(40, 2, recipe):
    ids = tok.apply_chat_template(_messages(row), tokenize=True, return_dict=False)
    mask = tok.apply_chat_template(_messages(row), tokenize=True, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    x = torch.tensor([ids])
    with torch.no_grad():
        o = model(input_ids=x, output_hidden_states=True)
    pred = o.logits[0, :-1].argmax(-1); tgt = x[0, 1:]; m = torch.tensor(mask[1:]).bool()
    correct += int((pred[m] == tgt[m]).sum()); total += int(m.sum())
    hs_all.append(torch.stack(o.hidden_states[:9])[:, 0])  # [9, T, H]
H = torch.cat(hs_all, 1)
n = lambda v: v / v.norm(dim=-1, keepdim=True)
for k in range(1, 8):
    a, b = H[k], H[k + 1]
    cos[k] = round(float((n(a) * n(b)).sum(-1).mean()), 3)
    ac, bc = a - a.mean(0), b - b.mean(0)
    ccos[k] = round(float((n(ac) * n(bc)).sum(-1).mean()), 3)
print("reply accuracy", round(correct / total, 3), "of", total)
print("cos(h_k, h_k+1)", cos); print("centered", ccos)
print("norms", [round(float(H[k].norm(dim=-1).mean()), 1) for k in range(9)])
