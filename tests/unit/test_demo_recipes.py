"""The demo conversations' recipes: seeded, and the `recall` recipe's words are single tokens of the demo
tokenizer (a word looked up in the prompt is one position, the copy an induction head makes)."""

import pytest

from eagle_states.demo import _KEYS, _VALUES, _train_tokenizer, demo_conversations


def test_recipes_are_seeded_and_the_default_is_chat():
    assert demo_conversations(8, 3) == demo_conversations(8, 3, "chat") != demo_conversations(8, 3, "recall")
    assert demo_conversations(8, 3, "recall") == demo_conversations(8, 3, "recall") != demo_conversations(8, 4, "recall")
    with pytest.raises(ValueError, match="recipe"):
        demo_conversations(1, 0, "poems")


def test_a_recall_reply_recites_the_prompts_pairs_in_single_tokens():
    tok = _train_tokenizer(2048, 0)
    assert not set(_KEYS) & set(_VALUES)
    for word in _KEYS + _VALUES:
        assert len(tok.encode(" " + word).ids) == 1, word
    for row in demo_conversations(20, 0, "recall"):
        prompt, reply = (t["value"] for t in row["conversations"])
        pairs = prompt.removeprefix("Remember: ")
        assert reply == f"I remember: {pairs}" and 6 <= pairs.count(".") <= 16
        keys = pairs.split(" ")[::2]
        assert len(set(keys)) == len(keys)  # each key once: the lookup has one answer
