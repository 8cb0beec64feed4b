"""Served against offline: vLLM's EAGLE-3 proposals of a trained draft, recorded draft by draft, beside the same
draft run offline with speculators' own model code on the same sequences (issue #27: served position-0 acceptance
far below the draft's validation accuracy; a train/serve mismatch, or the held-out distribution?).

    python bench/cpu-2026-12-02-offbyone/served_vs_offline.py TARGET DRAFT_DIR [--prompts 32 --max-tokens 48]
        [--prompt-tokens alone|in-conversation] [--json OUT]

1. Serve: the target with the draft through vLLM's EAGLE-3 (greedy, 3 speculative tokens, float32, the harness's
   engine arguments, one request at a time), `SpecDecodeBaseProposer.propose` wrapped to record every call's
   inputs (token ids, positions, the target's aux states) and its proposed draft tokens.
2. Offline: the target's states for prompt + served continuation from a Hugging Face forward (float32), entering
   layer k = hidden_states[k] at the draft's layer ids; the draft loaded into speculators' `Eagle3DraftModel`
   (float32, eager attention) and run on the sequence in speculators' training alignment (`shift_batch`: token
   x[t+1] with the state of x[t], positions from 1), 3 TTT steps (teacher-forced tokens, the draft's own states).
3. Compare, at exactly the positions vLLM drafted at: vLLM's proposals against offline's, and both against the
   target's tokens; the would-be acceptance per position of the offline chain; the offline position-0 accuracy
   at every continuation position; vLLM's aux states against HF's.
4. The validation metric (step 0 == the target's argmax where the input token is a reply token) on the held-out
   conversations with their own replies, teacher-forced (the same for both prompt tokenizations).
(vLLM's per-position counters also count tokens accepted after the request's last token (past its EOS); the
served_per_position here counts only drafts of tokens that were output.)
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("draft")
ap.add_argument("--prompts", type=int, default=32)
ap.add_argument("--prompt-seed", type=int, default=2)
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--k", type=int, default=3)
ap.add_argument("--json", default=None)
ap.add_argument("--prompt-tokens", choices=("alone", "in-conversation"), default="alone",
                help="alone: the opening turns tokenized by themselves (the harness's heldout_prompts before the fix); "
                     "in-conversation: the tokens before the reply in the whole conversation's rendering (as prepare "
                     "renders the training data; heldout_prompts since the fix)")
args = ap.parse_args()

import torch

from eagle_states.acceptance.harness import heldout_prompts
from eagle_states.capture.engine import running_on_cpu

target, draft_dir = Path(args.target), Path(args.draft)
from transformers import AutoTokenizer

from eagle_states.demo import demo_conversations
from eagle_states.prepare import renderer

# in-conversation: the harness's held-out prompts since the fix (the rendering of the whole conversation, as
# `prepare` renders the training data, up to the first reply token); alone: the opening turns tokenized by
# themselves with the generation prompt (the harness before the fix)
tok = AutoTokenizer.from_pretrained(target)
render, _ = renderer(tok)
recipe = json.loads((target / "target_training.json").read_text()).get("recipe", "chat")
roles = {"human": "user", "gpt": "assistant", "system": "system"}
alone, conversations = [], []
for row in demo_conversations(args.prompts, args.prompt_seed, recipe):
    msgs = []
    for turn in row["conversations"]:
        msgs.append({"role": roles[turn["from"]], "content": turn["value"]})
        if turn["from"] == "gpt":
            break
    alone.append(tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True, return_dict=False))
    conversations.append(render(tok, msgs))
in_conversation = heldout_prompts(target, args.prompts, args.prompt_seed)
assert in_conversation == [ids[:mask.index(1)] for ids, mask in conversations]
prompts = alone if args.prompt_tokens == "alone" else in_conversation
print("prompts differing between the two tokenizations:", sum(a != b for a, b in zip(alone, in_conversation)),
      "; the first one's last tokens alone / in conversation:", tok.convert_ids_to_tokens(alone[0][-3:]),
      tok.convert_ids_to_tokens(in_conversation[0][-3:]))
draft_cfg = json.loads((draft_dir / "config.json").read_text())
layer_ids = draft_cfg["eagle_aux_hidden_state_layer_ids"]

# ---------------------------------------------------------------- 1. serve, recording each proposal
from vllm.v1.spec_decode import llm_base_proposer as lbp

calls = []
_propose = lbp.SpecDecodeBaseProposer.propose


def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, *a, **kw):
    rec = {"tokens": target_token_ids.detach().cpu().clone(), "positions": target_positions.detach().cpu().clone(),
           "hidden": target_hidden_states.detach().float().cpu().clone(),
           "next": next_token_ids.detach().cpu().clone(),
           "sample_idx": None if token_indices_to_sample is None else token_indices_to_sample.detach().cpu().clone()}
    out = _propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                   next_token_ids, token_indices_to_sample, common_attn_metadata, *a, **kw)
    rec["draft"] = out.detach().cpu().clone()
    calls.append(rec)
    return out


lbp.SpecDecodeBaseProposer.propose = propose

from vllm import LLM, SamplingParams, TokensPrompt
from vllm.v1.metrics.reader import Counter, Vector

llm = LLM(model=str(target), dtype="float32", max_model_len=2048, max_num_seqs=1, enforce_eager=True,
          enable_prefix_caching=False, seed=0, disable_log_stats=False,
          **({"kv_cache_memory_bytes": 1 << 30} if running_on_cpu() else {"gpu_memory_utilization": 0.5}),
          speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": args.k},
          **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if running_on_cpu() else {}))
served = []  # per prompt: (generated ids, [its calls])
counters = {}
for p in prompts:  # one request at a time: every proposer call belongs to this prompt
    start = len(calls)
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                       use_tqdm=False)
    served.append((list(out[0].outputs[0].token_ids), calls[start:]))
for metric in llm.get_metrics():
    if isinstance(metric, Counter) and metric.name.startswith("vllm:spec_decode"):
        counters[metric.name] = counters.get(metric.name, 0) + metric.value
    elif isinstance(metric, Vector) and metric.name.startswith("vllm:spec_decode"):
        counters[metric.name] = list(metric.values)
del llm

# ---------------------------------------------------------------- 2. offline: HF target states, speculators' draft
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from transformers import AutoModelForCausalLM

hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
config = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
config.transformer_layer_config._attn_implementation = "eager"
draft = Eagle3DraftModel(config)
missing, unexpected = draft.load_state_dict({k: v.float() for k, v in load_file(draft_dir / "model.safetensors").items()},
                                            strict=False)
assert set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, missing
assert not unexpected, unexpected
draft = draft.float().eval()
d2t = draft.d2t


def to_target(ids):
    return ids + d2t[ids] if d2t is not None else ids


K = args.k
n_drafts = 0
acc_served = [0] * K  # vLLM's proposals accepted (recomputed from the served tokens)
acc_offline = [0] * K  # offline chain, full (all earlier positions right too), at the same drafts
agree = [0] * K  # vLLM's proposal == offline's (step 0 always; later steps where offline's chain is right so far)
agree_n = [0] * K
pos0_all = [0, 0]  # offline step 0 right / positions, at every continuation position
first_draft = [0, 0, 0]  # after prefill: drafts, vLLM right, offline right
state_err = []
mismatch_examples = []
with torch.no_grad():
    for p_i, (prompt, (gen, pcalls)) in enumerate(zip(prompts, served)):
        seq = torch.tensor(prompt + gen)
        P = len(prompt)
        hs = hf(seq[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[k][0] for k in layer_ids], dim=-1)  # [L, 3*H], entering layer k
        target_next = hf(seq[None]).logits[0].argmax(-1)  # target's greedy token after each position
        # vLLM's aux states for the prompt (first call: the prefill) against HF's
        first = pcalls[0]
        n = first["hidden"].shape[0]
        pos = first["positions"].long()
        ref = aux[pos]
        state_err.append(float(((first["hidden"] - ref).norm(dim=-1) / ref.norm(dim=-1)).max()))
        # speculators' alignment (shift_batch): token x[t+1] with the state of x[t], position t+1
        L = len(seq)
        draft_tokens = draft(hidden_states=aux[:-1][None], input_ids=seq[1:][None],
                             document_ids=torch.zeros(1, L - 1, dtype=torch.long),
                             position_ids=torch.arange(1, L)[None], ttt_steps=K)
        # draft_tokens[s][0, i]: step s of the chain that starts at shifted index i predicts x[i + 2 + s]
        off = [to_target(d[0]) for d in draft_tokens]
        # offline step 0 at every continuation position: predicts gen[j+1] from gen[j] (seq index P+j -> shifted P+j-1)
        for j in range(len(gen) - 1):
            pos0_all[1] += 1
            pos0_all[0] += int(off[0][P + j - 1] == seq[P + j + 1])
        # vLLM's drafts in order: the first after prefill drafts gen[1..K] from next token gen[0]
        j = 0
        for c_i, c in enumerate(pcalls):
            if j >= len(gen) - 1:  # nothing left to verify (vLLM counts no draft here)
                break
            d = c["draft"][0].tolist()
            assert int(c["next"][0]) == gen[j], (c_i, int(c["next"][0]), gen[j])
            n_drafts += 1
            i = P + j - 1  # shifted index of the pair (x[P+j], state of x[P+j-1])
            right_v = right_o = True
            for s in range(K):
                tgt = seq[P + j + 1 + s] if P + j + 1 + s < L else None
                o = int(off[s][i])
                if right_o:  # offline's chain right so far: the proposals should coincide
                    agree_n[s] += 1
                    agree[s] += int(o == d[s])
                    if s == 0 and o != d[s] and len(mismatch_examples) < 8:
                        mismatch_examples.append({"prompt": p_i, "j": j,
                                                  "vllm": d, "offline": [int(off[t][i]) for t in range(K)],
                                                  "target": seq[P + j + 1:P + j + 1 + K].tolist()})
                right_v = right_v and tgt is not None and d[s] == int(tgt)
                right_o = right_o and tgt is not None and o == int(tgt)
                acc_served[s] += int(right_v)
                acc_offline[s] += int(right_o)
            if c_i == 0:
                first_draft[0] += 1
                first_draft[1] += int(d[0] == (seq[P + 1] if P + 1 < L else -1))
                first_draft[2] += int(off[0][i] == (seq[P + 1] if P + 1 < L else -1))
            accepted = 0
            for s in range(K):
                if j + 1 + s < len(gen) and d[s] == gen[j + 1 + s]:
                    accepted += 1
                else:
                    break
            j += accepted + 1
        # greedy speculative decoding gives the target's own tokens
        assert (target_next[P - 1:L - 1] == seq[P:]).float().mean() > 0.99

# 4. the held-out conversations with their own (data) replies, teacher-forced: the validation metric (step 0 ==
# the target's argmax where the input token is a reply token, speculators' loss mask after shift_batch) on the
# held-out prompts, beside the same on the target's own greedy continuations (above)
right = total = 0
with torch.no_grad():
    for ids, mask in conversations:
        seq = torch.tensor(ids)
        out = hf(seq[None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k][0] for k in layer_ids], dim=-1)
        tgt = out.logits[0].argmax(-1)
        L = len(seq)
        d0 = to_target(draft(hidden_states=aux[:-1][None], input_ids=seq[1:][None],
                             document_ids=torch.zeros(1, L - 1, dtype=torch.long),
                             position_ids=torch.arange(1, L)[None], ttt_steps=1)[0][0])
        for i in range(L - 1):
            if mask[i + 1]:
                total += 1
                right += int(d0[i] == tgt[i + 1])
data_replies = {"step0_equals_target_argmax": round(right / total, 4), "positions": total}

report = {
    "data_replies_teacher_forced": data_replies,
    "prompt_tokens": args.prompt_tokens, "target": str(target), "draft": str(draft_dir), "layer_ids": layer_ids, "prompts": len(prompts),
    "output_tokens": sum(len(g) for g, _ in served),
    "vllm_counters": {"drafts": counters.get("vllm:spec_decode_num_drafts"),
                      "accepted_per_pos": counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")},
    "drafts_recorded": n_drafts,
    "served_per_position": [round(a / n_drafts, 4) for a in acc_served],
    "offline_per_position_same_drafts": [round(a / n_drafts, 4) for a in acc_offline],
    "vllm_equals_offline_proposal": [round(a / max(1, n), 4) for a, n in zip(agree, agree_n)],
    "vllm_equals_offline_n": agree_n,
    "offline_pos0_every_continuation_position": round(pos0_all[0] / pos0_all[1], 4), "positions": pos0_all[1],
    "first_draft_after_prefill": {"drafts": first_draft[0], "vllm_right": first_draft[1],
                                  "offline_right": first_draft[2]},
    "vllm_vs_hf_aux_state_max_rel_err": max(state_err),
    "mismatch_examples": mismatch_examples,
}
print(json.dumps(report, indent=1))
if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
