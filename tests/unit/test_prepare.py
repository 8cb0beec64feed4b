"""Prompt preparation on real ShareGPT conversations and on bad rows of every kind (no engine needed)."""

import json
import shutil

import pandas as pd
import pytest

from eagle_states.config import PrepareParams
from helpers import SHARED_DATA
from eagle_states.cli import main as cli
from eagle_states.prepare import (NotAConversationDataset, load_tokenizer, prepare,
                                  render_by_prefix_diff, render_with_markers, to_messages)

SHAREGPT = SHARED_DATA / "sharegpt_dummy_conversation.json"


def masked_spans(tokenizer, ids, mask):
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


@pytest.fixture(scope="module")
def tokenizer(llama_model):
    return load_tokenizer(llama_model)


@pytest.fixture(scope="module")
def sharegpt_run(tmp_path_factory, llama_model):
    out = tmp_path_factory.mktemp("prep")
    report = prepare(SHAREGPT, llama_model, out / "a", PrepareParams(max_length=100000), fmt="auto", progress=False)
    return out, report


def test_every_sharegpt_conversation_is_prepared(sharegpt_run):
    out, report = sharegpt_run
    assert report["format"] == "sharegpt"
    assert report["rows_read"] == report["rows_written"] == 500 and report["rows_skipped"] == 0
    frame = pd.read_parquet(out / "a" / "samples.parquet")
    assert len(frame) == 500 and frame["sample_id"].is_unique
    assert (frame["num_tokens"] == frame["input_ids"].map(len)).all()
    assert (frame["num_loss_tokens"] == frame["loss_mask"].map(sum)).all()
    freq = json.loads((out / "a" / "token_freq.json").read_text())
    assert freq["total"] == frame["num_loss_tokens"].sum()


def test_masks_cover_exactly_the_assistant_turns(sharegpt_run, tokenizer):
    out, _ = sharegpt_run
    source = json.loads(SHAREGPT.read_text())
    frame = pd.read_parquet(out / "a" / "samples.parquet")
    for row in frame.itertuples():
        conversation = source[row.source_row - 1]["conversations"]
        expected = [t["value"] + "<|eot_id|>" for t in conversation if t["from"] == "gpt"]
        assert masked_spans(tokenizer, list(row.input_ids), list(row.loss_mask)) == expected, row.source_row


def test_ids_are_stable_across_runs(sharegpt_run, llama_model):
    out, _ = sharegpt_run
    prepare(SHAREGPT, llama_model, out / "b", PrepareParams(max_length=100000), fmt="auto", progress=False)
    a, b = (pd.read_parquet(out / d / "samples.parquet") for d in ("a", "b"))
    assert list(a["sample_id"]) == list(b["sample_id"])
    assert (out / "a" / "samples.parquet").read_bytes() == (out / "b" / "samples.parquet").read_bytes()


def test_prefix_diff_agrees_with_generation_markers(tokenizer):
    source = json.loads(SHAREGPT.read_text())
    for row in source:
        messages = to_messages(row, "sharegpt")
        assert render_by_prefix_diff(tokenizer, messages) == render_with_markers(tokenizer, messages)


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"},
     {"role": "assistant", "content": "Bye."}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Fine."},
     {"role": "assistant", "content": "Good."}],
])
def test_system_message_and_assistant_first(tokenizer, messages):
    ids, mask = render_with_markers(tokenizer, messages)
    assert masked_spans(tokenizer, ids, mask) == [m["content"] + "<|eot_id|>" for m in messages
                                                  if m["role"] == "assistant"]
    assert render_by_prefix_diff(tokenizer, messages) == (ids, mask)


BAD_ROWS = [
    (b'{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}', None),
    (b'{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hel', "malformed_json"),
    (b'{"conversations": [{"from": "wizard", "value": "Hi"}, {"from": "gpt", "value": "x"}]}', "unknown_role"),
    (b'{"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]}', "empty_content"),
    (b'{"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x"}]}', "non_string_content"),
    (b'{"conversations": [{"from": "human", "value": "Only a question"}]}', "no_assistant_turn"),
    (b'{"conversations": [{"from": "human", "value": "Hi \xff\xfe there"}, {"from": "gpt", "value": "x"}]}',
     "invalid_utf8"),
    (b'{"conversations": [{"from": "human", "value": "' + b"long " * 400 + b'"}, {"from": "gpt", "value": "x"}]}',
     "too_long"),
    (b'[1, 2, 3]', "not_an_object"),
    (b'{"conversations": "nope"}', "missing_turns"),
    (b'{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}', "duplicate"),
]


def test_bad_rows_are_recorded_with_their_reasons(tmp_path, llama_model):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join(line for line, _ in BAD_ROWS) + b"\n")
    report = prepare(data, llama_model, tmp_path / "out", PrepareParams(max_length=256, overlong="drop"), fmt="auto",
                     progress=False)
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    expected = [(n, reason) for n, (_, reason) in enumerate(BAD_ROWS, start=1) if reason]
    assert [(s["source_row"], s["reason"]) for s in skipped] == expected
    assert all(s["detail"] for s in skipped)
    assert report["rows_read"] == len(BAD_ROWS) == report["rows_written"] + report["rows_skipped"]
    assert report["rows_written"] == 1


def test_options_truncate_limit_shuffle_and_keep_duplicates(tmp_path, llama_model):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}"},
                          {"role": "assistant", "content": "answer " * (5 + i)}]} for i in range(10)]
    rows.append(rows[0])
    data = tmp_path / "messages.json"
    data.write_text(json.dumps(rows))
    report = prepare(data, llama_model, tmp_path / "a", PrepareParams(max_length=30, limit=4, shuffle_seed=3,
                                                                         dedup=False), fmt="auto", progress=False)
    frame = pd.read_parquet(tmp_path / "a" / "samples.parquet")
    assert report["format"] == "messages" and len(frame) == 4
    assert (frame["num_tokens"] <= 30).all() and (frame["num_tokens"] == 30).any()
    assert report["skipped_by_reason"] == {"over_limit": 7}
    assert list(frame["source_row"]) != sorted(frame["source_row"])  # shuffled
    report = prepare(data, llama_model, tmp_path / "b", PrepareParams(dedup=False), fmt="auto", progress=False)
    ids = pd.read_parquet(tmp_path / "b" / "samples.parquet")["sample_id"]
    assert report["rows_written"] == 11 and ids.is_unique and ids[10] == ids[0] + "-1"


def test_plain_prompt_and_text_rows(tmp_path, llama_model, tokenizer):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Say hi", "completion": "Hi!"}) + "\n"
                    + json.dumps({"text": "A plain document."}) + "\n" + json.dumps({"prompt": "No answer"}) + "\n")
    report = prepare(data, llama_model, tmp_path / "out", PrepareParams(), fmt="auto", progress=False)
    assert report["format"] == "prompt" and report["skipped_by_reason"] == {"no_assistant_turn": 1}
    frame = pd.read_parquet(tmp_path / "out" / "samples.parquet")
    assert masked_spans(tokenizer, list(frame.input_ids[0]), list(frame.loss_mask[0])) == ["Hi!<|eot_id|>"]
    assert all(frame.loss_mask[1])


def test_a_file_that_is_not_a_conversation_dataset_gets_one_clear_error(tmp_path, llama_model, capsys):
    data = tmp_path / "table.jsonl"
    data.write_text('{"a": 1}\n{"b": 2}\n')
    with pytest.raises(NotAConversationDataset, match="not a conversation dataset"):
        prepare(data, llama_model, tmp_path / "out", PrepareParams(), fmt="auto", progress=False)
    assert cli(["prepare", "--data", str(data), "--model", str(llama_model), "--out", str(tmp_path / "o")]) == 2
    assert "not a conversation dataset" in capsys.readouterr().err


def test_cli_prepare_on_a_copy_of_the_real_data(tmp_path, llama_model):
    shutil.copy(SHAREGPT, tmp_path / "data.json")
    assert cli(["prepare", "--data", str(tmp_path / "data.json"), "--model", str(llama_model), "--out",
                str(tmp_path / "out"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["rows_written"] == 500
