"""The demo conversations' recipes: seeded, and the `recall` recipe's words are single tokens of the demo
tokenizer (a word looked up in the prompt is one position, the copy an induction head makes)."""

import pytest

from eagle_states.demo import _KEYS, _VALUES, _train_tokenizer, demo_conversations


def test_recipes_are_seeded_and_the_default_is_chat():
    assert demo_conversations(8, 3) == demo_conversations(8, 3, "chat") != demo_conversations(8, 3, "recall")
    recall = demo_conversations(8, 3, "recall")
    assert recall == demo_conversations(8, 3, "recall") != demo_conversations(8, 4, "recall")
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


def test_a_keyed_reply_walks_the_pool_by_the_successor_map_its_prompt_names():
    """Each mode's map is one cycle through the same words (the current word alone does not say the next: that
    takes the key, back in the prompt); the maps are fixed, the same for every seed."""
    from eagle_states.demo import _FILLER, _MODE_KEYS, _MODE_WORDS, mode_successors

    tok = _train_tokenizer(2048, 0)
    for word in _MODE_KEYS + _MODE_WORDS + _FILLER:
        assert len(tok.encode(" " + word).ids) == 1, word
    maps = mode_successors()
    assert maps == mode_successors() and set(maps) == set(_MODE_KEYS)
    for successor in maps.values():
        word, seen = _MODE_WORDS[0], []
        for _ in _MODE_WORDS:
            seen.append(word)
            word = successor[word]
        assert word == _MODE_WORDS[0] and sorted(seen) == sorted(_MODE_WORDS)  # one cycle through all
    ambiguous = sum(len({m[w] for m in maps.values()}) >= len(maps) - 1 for w in _MODE_WORDS)
    assert ambiguous >= len(_MODE_WORDS) // 2  # most words have (nearly) as many successors as there are modes
    rows = demo_conversations(200, 0, "keyed")
    assert len({row["conversations"][0]["value"] for row in rows}) == len(rows)  # prompts do not repeat
    assert rows == demo_conversations(200, 0, "keyed") != demo_conversations(200, 1, "keyed")
    for row in rows:
        prompt, reply = (t["value"] for t in row["conversations"])
        filler, command = prompt.split(". Walk ")
        key, start = command.removesuffix(".").split(" from ")
        assert not {w.lower() for w in filler.split(" ")} & set(_MODE_KEYS + _MODE_WORDS)  # the key said once
        words = reply.removesuffix(".").split(" ")
        assert words[0] == start and 12 <= len(words) <= 19 and len(set(words)) == len(words)
        assert all(maps[key][a] == b for a, b in zip(words, words[1:]))
