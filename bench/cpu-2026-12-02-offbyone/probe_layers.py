"""Where the keyed target holds the mode: linear probe (least squares one-vs-rest on normalized states) of the
conversation's mode key from the state entering each layer, at reply positions; train on 200, test on 100."""
import sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eagle_states.demo_training import _messages
from eagle_states.demo import demo_conversations, _MODE_KEYS
from transformers import AutoModelForCausalLM, AutoTokenizer
out = Path(sys.argv[1]); torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(out); model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
X = {k: [] for k in range(9)}; Y = []
rows = demo_conversations(300, 5, "keyed")
for row in rows:
    key = row["conversations"][0]["value"].split("Walk ")[1].split()[0]
    msgs = _messages(row)
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], torch.tensor(enc["assistant_masks"]).bool()
    with torch.no_grad():
        o = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for k in range(9):
        h = o.hidden_states[k][0][mask]
        X[k].append(h / h.norm(dim=-1, keepdim=True))
    Y += [_MODE_KEYS.index(key)] * int(mask.sum())
Y = torch.tensor(Y); n_train = sum(int(x.shape[0]) for x in X[0][:200])
for k in range(9):
    A = torch.cat(X[k]); A = torch.cat([A, torch.ones(len(A), 1)], 1)
    T = torch.nn.functional.one_hot(Y, len(_MODE_KEYS)).float()
    W = torch.linalg.lstsq(A[:n_train], T[:n_train], driver="gelsd").solution
    acc = float((A[n_train:] @ W).argmax(-1).eq(Y[n_train:]).float().mean())
    print(f"entering layer {k}: mode probe accuracy {acc:.3f}")
