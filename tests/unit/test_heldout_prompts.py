"""The acceptance harness's held-out prompts are the tokens a prompt has in the training data: the rendering of the
whole conversation by `prepare` up to its first reply token. Tokenized by themselves, the opening turns end with
another token where BPE merges across the end of the string (the demo tokenizer: "<|end_header_id|>\\n\\n" alone
is [..., 'ĊĊ'], inside a conversation [..., 'Ċ', 'Ċ']): served on such prompts the keyed draft's position-0
acceptance was 0.45 against 0.85 (bench/RESULTS.md, "Served against offline draft accuracy")."""

import json
import shutil

import pandas as pd
import pytest

from eagle_states.acceptance.harness import heldout_prompts
from eagle_states.config import PrepareParams
from eagle_states.demo import write_demo_conversations
from eagle_states.prepare import prepare


@pytest.mark.parametrize("recipe", ["chat", "keyed"])
def test_heldout_prompts_are_the_training_renderings_tokens_before_the_reply(tmp_path, llama_model, recipe):
    model = shutil.copytree(llama_model, tmp_path / "model")
    (model / "target_training.json").write_text(json.dumps({"recipe": recipe}))
    count, seed = 12, 2
    prompts = heldout_prompts(model, count, seed)
    data = write_demo_conversations(tmp_path / "conversations.jsonl", count=count, seed=seed, recipe=recipe)
    prepare(data, model, tmp_path / "prepared", PrepareParams(dedup=False), fmt="auto", progress=False)
    samples = pd.read_parquet(next((tmp_path / "prepared").glob("*.parquet"))).sort_values("source_row")
    assert len(samples) == len(prompts) == count
    for prompt, (_, sample) in zip(prompts, samples.iterrows()):
        ids, mask = list(sample.input_ids), list(sample.loss_mask)
        assert prompt == ids[:mask.index(1)]
