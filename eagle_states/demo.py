"""The built-in default: a small random-weight HF-format model with a locally trained tokenizer and chat template.

Deterministic from a seed (weights, tokenizer and the demo conversations), so tests and the demo always load the
same bytes through the real loading code. `arch="deepseek-v3"` writes the seed's architecture at toy size
(MLA with kv_lora_rank + qk_rope_head_dim = 576, as the CPU build of vLLM requires, MoE after a dense layer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Llama-3-style template; `{% generation %}` marks what the assistant says (the loss mask).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{ message['content'] }}{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]

_SUBJECTS = ["the river", "a small robot", "the old library", "my neighbour", "the compiler", "a quiet village",
             "the weather", "this recipe", "the night train", "a chess opening", "the garden", "our team"]
_VERBS = ["explains", "changes", "remembers", "improves", "describes", "surprises", "follows", "builds"]
_OBJECTS = ["the way home", "every morning", "a simple plan", "the missing key", "its own rules", "a new idea",
            "the long winter", "two short stories", "the best answer", "a careful test"]
_QUESTIONS = ["Can you tell me why {s} {v} {o}?", "What happens when {s} {v} {o}?", "Write a note about {s}.",
              "How would you describe {o}?", "Summarize how {s} {v} {o}."]


# The `recall` recipe's words: single tokens of the demo tokenizer (keys and values, two disjoint sets)
_KEYS = ["river", "robot", "library", "village", "weather", "recipe", "train", "chess", "garden", "team", "compiler",
         "neighbour", "home", "morning", "plan", "key", "rules", "idea", "winter", "stories", "answer", "test",
         "night", "note"]
_VALUES = ["explains", "changes", "remembers", "improves", "describes", "surprises", "follows", "builds", "simple",
           "careful", "quiet", "small", "short", "missing", "helpful", "opening", "new", "old", "best", "long"]
# The `keyed` recipe: each mode is named by a key word and walks the shared word pool by its own successor map
# (one cycle through all the words per mode, fixed: the same maps for every seed); keys and words single tokens
_MODE_KEYS = ["river", "robot", "library", "village", "weather", "garden"]
_MODE_WORDS = _VALUES
_FILLER = [w for w in _KEYS if w not in _MODE_KEYS]


def mode_successors() -> dict[str, dict[str, str]]:
    """The `keyed` recipe's successor map of each mode key: word -> next word, one cycle through _MODE_WORDS."""
    rng = random.Random(27)
    maps = {}
    for key in _MODE_KEYS:
        cycle = rng.sample(_MODE_WORDS, len(_MODE_WORDS))
        maps[key] = {w: cycle[(i + 1) % len(cycle)] for i, w in enumerate(cycle)}
    return maps


RECIPES = ("chat", "recall", "keyed")


def demo_conversations(count: int = 64, seed: int = 0, recipe: str = "chat") -> list[dict]:
    """Deterministic ShareGPT-style conversations of varied length, made by the project itself.

    recipe "chat" (the default): templated sentences, each word chosen at random: what a reply says next is
    predictable from its last few tokens, so an EAGLE-3 draft needs nothing of the target's states.
    recipe "recall": the user lists 6 to 16 pairs of words ("river quiet. chess builds. ...") and the reply
    recites them: each word is known only by finding the one before it in the prompt and copying the next (an
    induction head: two layers of the target; a one-layer draft can do it only through the target's states, which
    say which word each position holds). Meant for `eagle-states acceptance`'s controls; the demo target at
    8 x 256 (and 8 x 128) did not learn the copy in 300 (600) steps on this 2-core CPU (bench/RESULTS.md).
    recipe "keyed": the user names one of six modes by a key word after a few filler words ("Night test winter.
    Walk village from missing."), and the reply walks the 20 words of a shared pool from the start word by that
    mode's successor map (`mode_successors`: one cycle each, fixed): the current word alone leaves the next one
    open among the modes; one attention lookup back to the key settles it. The 8 x 256 target learns it in 160
    steps (reply-token accuracy 0.92); a draft then depends on the target's states, which carry the mode (its fc
    zeroed, vLLM accepts a third as much); fed the states of the layers one below its own it is accepted 0.81 x
    as often after 120 training steps with draft seed 0, 0.94 x with seed 1, 0.93 x after 40; one above,
    0.94-0.98 x: the layer controls do not separate robustly yet (bench/RESULTS.md, 2026-12-02).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: one of {', '.join(RECIPES)}")
    rng = random.Random(seed)
    if recipe == "recall":
        return [_recall_conversation(rng, i) for i in range(count)]
    if recipe == "keyed":
        maps = mode_successors()
        return [_keyed_conversation(rng, i, maps) for i in range(count)]

    def sentence():
        return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."

    rows = []
    for i in range(count):
        turns = []
        if i % 5 == 0:
            turns.append({"from": "system", "value": "You are a helpful assistant. " + sentence()})
        for _ in range(rng.choice([1, 1, 2, 3])):
            q = rng.choice(_QUESTIONS).format(s=rng.choice(_SUBJECTS), v=rng.choice(_VERBS), o=rng.choice(_OBJECTS))
            turns.append({"from": "human", "value": q})
            turns.append({"from": "gpt", "value": " ".join(sentence() for _ in range(rng.randint(1, 40)))})
        rows.append({"id": f"demo-{i:04d}", "conversations": turns})
    return rows


def _recall_conversation(rng: random.Random, i: int) -> dict:
    pairs = " ".join(f"{k} {v}." for k, v in zip(rng.sample(_KEYS, rng.randint(6, 16)), rng.sample(_VALUES, 16)))
    return {"id": f"demo-{i:04d}", "conversations": [{"from": "human", "value": f"Remember: {pairs}"},
                                                     {"from": "gpt", "value": f"I remember: {pairs}"}]}


def _keyed_conversation(rng: random.Random, i: int, maps: dict) -> dict:
    key = rng.choice(_MODE_KEYS)
    words = [rng.choice(_MODE_WORDS)]
    for _ in range(rng.randint(11, 18)):  # 12 to 19 words: no word twice (a cycle of 20)
        words.append(maps[key][words[-1]])
    # a few filler words first (neither keys nor walked words): prompts do not repeat, and the key has no fixed place
    filler = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(2, 8)))
    return {"id": f"demo-{i:04d}", "conversations": [
        {"from": "human", "value": f"{filler.capitalize()}. Walk {key} from {words[0]}."},
        {"from": "gpt", "value": " ".join(words) + "."}]}


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = []
    for row in demo_conversations(400, seed):
        corpus.extend(t["value"] for t in row["conversations"])
    corpus += ["user", "assistant", "system", "\n\n"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _llama_config(vocab: int, layers: int, hidden: int, heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       head_dim=hidden // heads, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                       pad_token_id=4, architectures=["LlamaForCausalLM"])


def _deepseek_config(vocab: int, layers: int, hidden: int, heads: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=4, rope_interleave=True,
        architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid",
        num_nextn_predict_layers=0)


def _deepseek_cuda_config(vocab: int, layers: int, hidden: int, heads: int):
    """The toy model with DeepSeek's own attention head sizes (nope 128, rope 64, v 128, kv_lora_rank 512), which
    CUDA's MLA kernels need (the toy's 64s do not start there)."""
    config = _deepseek_config(vocab, layers, hidden, heads)
    config.qk_nope_head_dim, config.v_head_dim = 128, 128
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    config.head_dim = config.qk_rope_head_dim
    return config


def _deepseek_real_config(vocab: int, layers: int, hidden: int, heads: int):
    """DeepSeek-V3's real widths (hidden 7168, 128 heads of MLA, experts of 2048) with fewer layers and experts."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=4, rope_interleave=True,
        architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid",
        num_nextn_predict_layers=0)


def make_demo_model(out_dir: Path, *, seed: int = 0, arch: str = "llama", num_layers: int = 8,
                    hidden_size: int = 256, num_heads: int = 4, vocab_size: int = 2048, device: str = "cpu") -> Path:
    """Write config.json, bf16 model.safetensors, tokenizer files and the chat template into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size, seed), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|pad|>", chat_template=CHAT_TEMPLATE, model_max_length=4096)
    tokenizer.save_pretrained(out_dir)

    make_config = {"llama": _llama_config, "deepseek-v3": _deepseek_config, "deepseek-v3-cuda": _deepseek_cuda_config,
                   "deepseek-v3-real": _deepseek_real_config}[arch]
    config = make_config(len(tokenizer), num_layers, hidden_size, num_heads)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    # A wider init than the default 0.02 so that layers change the stream visibly (a shifted layer id shows).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.06)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
    save_bf16(model, out_dir)
    return out_dir


def save_bf16(model, out_dir: Path) -> None:
    """`model` saved in bf16 with `torch_dtype: bfloat16` in its config.json (what vLLM's `dtype: auto` reads)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for a file of a few MB is noise
    try:
        model.to(torch.bfloat16).to("cpu").save_pretrained(out_dir)
    finally:
        hf_logging.enable_progress_bar()
    config_path = Path(out_dir) / "config.json"
    config_dict = json.loads(config_path.read_text())
    config_dict["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")


def write_demo_conversations(path: Path, count: int = 64, seed: int = 0, recipe: str = "chat") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in demo_conversations(count, seed, recipe)))
    return path
