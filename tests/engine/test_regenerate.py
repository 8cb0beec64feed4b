"""Regeneration on the CPU build (fp32), on one engine: the target model's own replies, turn by turn (each assistant
span of a sample decodes to exactly the text generated for it, every row written or skipped with its reason, greedy
reruns give the same tokens and bytes), and the states captured while generating equal Hugging Face's for the final
token ids, and a prefill capture's layout, on 14 conversations of mixed lengths and turns with chunked prefill.

The model is the demo model with a second end-of-turn token in generation_config.json (as Llama 3 has two), a token
its greedy replies use often: so some turns stop at it and others run to max_new_tokens.
"""

import json
import shutil
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from eagle_states import stages
from eagle_states.capture.engine import EngineHolder
from eagle_states.config import PipelineParams
from eagle_states.dataset import layout
from eagle_states.dataset.files import sha256_file
from eagle_states.dataset.reader import Dataset
from eagle_states.demo import demo_conversations
from eagle_states.prepare import load_tokenizer
from eagle_states.regenerate import CONVERSATIONS_FILE
from helpers import CountingEngines, hf_states, load_hf, rel_error

LAYERS = [0, 2, 4, 5, 8]
MAX_NEW_TOKENS = 32


def conversation_rows() -> list:
    """14 good conversations in the OpenAI `messages` format (1 to 3 turns, system prompts, a lone question, a
    conversation that ends with its user's question) among bad rows of every kind; the JSONL writer below turns
    `None` into a line that is not JSON."""
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    good = [{"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]}
            for row in demo_conversations(11, seed=7)]
    good.append({"messages": [{"role": "user", "content": "Can you tell me why the river follows the way home?"}]})
    good.append({"messages": [{"role": "user", "content": "Write a note about the garden."},
                              {"role": "assistant", "content": "It is green."},
                              {"role": "user", "content": "And the old library?"}]})
    good.append({"messages": [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "How would you describe a new idea?"}]})
    bad = [None, [1, 2], {"messages": [{"role": "user", "content": "  "}]},
           {"text": "a plain text row has nothing to answer"},
           {"messages": [{"role": "user", "content": "the old library " * 300}]},
           {"messages": [{"role": "narrator", "content": "Once upon a time"}]}]
    rows = good[:5] + bad[:3] + good[5:10] + bad[3:] + good[10:]
    return rows


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(("{not json" if row is None else json.dumps(row)) + "\n" for row in rows))
    return path


def regenerate_params(model: Path, data: Path, tmp: Path, name: str, capture: bool = True, **regenerate):
    return PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "data": {"path": str(data), "build_demo_if_missing": False},
        "prepare": {"max_length": 400, "out": str(tmp / f"{name}.prepared")},
        "regenerate": {"enabled": True, "capture": capture, "max_new_tokens": MAX_NEW_TOKENS,
                       "out": str(tmp / f"{name}.regenerated"), **regenerate},
        "extract": {"layer_ids": LAYERS, "dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 32,
                    "max_num_seqs": 8, "shard_max_tokens": 384, "gpu_memory_utilization": 0.2},
        "validate": {"report": str(tmp / f"{name}.validation.json")},
        "output": {"dir": str(tmp / name), "prefect_results": str(tmp / ".prefect-results")}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("regenerate")
    model = shutil.copytree(llama_model, tmp / "model")
    data = write_rows(tmp / "conversations.jsonl", conversation_rows())
    counting = CountingEngines()
    engines = EngineHolder(counting)
    # a first greedy pass with the tokenizer's end-of-turn token only: which token is in about a third of the
    # last replies (which then stop at it, the others running to max_new_tokens)?
    probe = stages.regenerate(regenerate_params(model, data, tmp, "probe", capture=False), engines=engines)
    assert probe.truncated_turns == probe.turns_generated  # a random model does not say <|eot_id|> by itself
    samples = pd.read_parquet(tmp / "probe.regenerated" / "samples.parquet")
    replies = [set(ids[-MAX_NEW_TOKENS:].tolist()) for ids in samples.input_ids]
    in_replies = Counter(t for reply in replies for t in reply if t > 4)  # not a special token
    stop = min(in_replies, key=lambda t: (abs(in_replies[t] - len(replies) / 3), t))
    config = json.loads((model / "generation_config.json").read_text())
    stops = {**config, "eos_token_id": [config["eos_token_id"], stop]}
    (model / "generation_config.json").write_text(json.dumps(stops))
    yield {"tmp": tmp, "model": model, "data": data, "engines": engines, "counting": counting, "stop": stop}
    engines.close()


@pytest.fixture(scope="module")
def one_pass(setup):
    params = regenerate_params(setup["model"], setup["data"], setup["tmp"], "one-pass")
    outcome = stages.regenerate(params, engines=setup["engines"])
    loaded = setup["counting"].created
    extracted = stages.extract(params, engines=setup["engines"])
    assert setup["counting"].created == loaded  # the extract step only finalizes what regeneration captured
    validation = stages.validate(params)
    return {"params": params, "outcome": outcome, "extracted": extracted, "validation": validation}


def read_regenerated(out: Path):
    samples = pd.read_parquet(out / "samples.parquet")
    conversations = [json.loads(line) for line in (out / CONVERSATIONS_FILE).read_text().splitlines()]
    return samples, conversations


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_every_row_is_written_or_skipped_with_its_reason(one_pass, setup):
    report = json.loads((Path(one_pass["params"].regenerate.out) / "report.json").read_text())
    assert report["rows_read"] == 20 and report["rows_written"] == 14 and report["rows_skipped"] == 6
    assert report["skipped_by_reason"] == {"context_too_long": 1, "empty_content": 1, "malformed_json": 1,
                                           "missing_turns": 1, "not_an_object": 1, "unknown_role": 1}
    skipped = [json.loads(line) for line in (Path(one_pass["params"].regenerate.out) / "skipped.jsonl")
               .read_text().splitlines()]
    assert {s["source_row"] for s in skipped} == {6, 7, 8, 14, 15, 16}
    too_long = next(s for s in skipped if s["reason"] == "context_too_long")
    assert "turn 0" in too_long["detail"] and "prepare.max_length 400" in too_long["detail"]
    samples, _ = read_regenerated(Path(one_pass["params"].regenerate.out))
    assert sorted(samples.source_row) == [r for r in range(1, 21) if r not in {6, 7, 8, 14, 15, 16}]
    # the sampling settings and the model are recorded
    assert report["settings"]["max_new_tokens"] == MAX_NEW_TOKENS and report["settings"]["temperature"] == 0.0
    assert report["model"]["weights_fingerprint"] and report["stop_token_ids"] == sorted({1, setup["stop"]})


def test_each_assistant_span_decodes_to_the_generated_text(one_pass, setup):
    tokenizer = load_tokenizer(setup["model"])
    samples, conversations = read_regenerated(Path(one_pass["params"].regenerate.out))
    assert list(samples.sample_id) == [c["id"] for c in conversations]
    turns = 0
    for sample, conversation in zip(samples.itertuples(), conversations):
        replies = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
        found = [tokenizer.decode(sample.input_ids[a:b], skip_special_tokens=True) for a, b in spans(sample.loss_mask)]
        assert found == replies, sample.sample_id
        turns += len(replies)
        # the conversation as text renders back to the sample's prompt: the template's own rendering of it
        prompt_len = spans(sample.loss_mask)[-1][0]
        rendered = tokenizer.apply_chat_template(conversation["messages"][:-1], add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]
        assert list(sample.input_ids[:prompt_len]) == list(rendered)
    assert turns == one_pass["outcome"].turns_generated
    by_row = {c["source_row"]: c["messages"] for c in conversations}
    assert [m["role"] for m in by_row[19]] == ["user", "assistant", "user", "assistant"]  # the question answered
    assert by_row[19][1]["content"] != "It is green."  # every assistant turn is regenerated, in order
    assert [m["role"] for m in by_row[18]] == ["user", "assistant"]  # a lone question gets its answer
    assert [m["role"] for m in by_row[20]] == ["system", "user", "assistant"]


def test_turns_stop_at_an_end_token_or_are_cut_and_counted(one_pass, setup):
    samples, conversations = read_regenerated(Path(one_pass["params"].regenerate.out))
    outcome = one_pass["outcome"]
    assert 0 < outcome.truncated_turns < outcome.turns_generated
    stopped = [ids for ids in samples.input_ids if ids[-1] == setup["stop"]]
    assert stopped and len(stopped) < len(samples)
    assert sum(c["truncated_turns"] for c in conversations) == outcome.truncated_turns


def test_states_captured_while_generating_match_hf_fp32(one_pass, setup):
    hf = load_hf(setup["model"], torch.float32)
    dataset = Dataset(Path(one_pass["params"].output.dir))
    samples, _ = read_regenerated(Path(one_pass["params"].regenerate.out))
    assert dataset.manifest["engine"]["regenerate.capture"] is True  # recorded: states from generation
    assert len(dataset.manifest["shards"]) > 2 and dataset.manifest["num_samples"] == 14
    lengths = set()
    for sample, prepared in zip(dataset, samples.itertuples()):
        assert sample.sample_id == prepared.sample_id
        assert sample.input_ids.tolist() == list(prepared.input_ids)  # the final token ids, the last one included
        assert sample.loss_mask.tolist() == list(prepared.loss_mask)
        lengths.add(len(prepared.input_ids))
        reference = hf_states(hf, list(prepared.input_ids), LAYERS)
        for j, k in enumerate(LAYERS):
            assert sample.hidden_states[j].shape == reference[j].shape
            error = rel_error(sample.hidden_states[j], reference[j])
            assert error <= 1e-5, f"{sample.sample_id} layer {k}: {error:.2e}"
    assert max(lengths) > 3 * 32 and len(lengths) > 8  # several prefill chunks, mixed lengths
    assert one_pass["validation"].valid


def test_same_layout_as_a_prefill_capture_of_the_same_ids(one_pass, setup):
    """Extracting the regenerated ids by prefill gives the same keys, shapes, dtypes, ids, masks and index; only
    the states' last bits may differ (other batches)."""
    params = one_pass["params"]
    prefill = params.override({"regenerate.enabled": False, "regenerate.capture": False,
                               "extract.input": params.regenerate.out,
                               "output.dir": str(setup["tmp"] / "prefill")})
    stages.extract(prefill, engines=setup["engines"])
    ours, theirs = Dataset(Path(params.output.dir)), Dataset(setup["tmp"] / "prefill")
    assert pd.read_parquet(Path(params.output.dir) / layout.INDEX_FILE).equals(
        pd.read_parquet(setup["tmp"] / "prefill" / layout.INDEX_FILE))
    for a, b in zip(ours, theirs):
        assert (a.sample_id, a.input_ids.tolist(), a.loss_mask.tolist()) == \
            (b.sample_id, b.input_ids.tolist(), b.loss_mask.tolist())
        for x, y in zip(a.hidden_states, b.hidden_states):
            assert x.shape == y.shape and x.dtype == y.dtype and rel_error(x, y) <= 1e-5
    stats = setup["engines"].engine.capture_stats()
    assert stats.generated_rows > 0 and stats.decode_rows_dropped >= 0


def test_a_rerun_is_fully_cached_and_loads_no_model(one_pass, setup):
    params = one_pass["params"]
    shards = {p.name: p.stat().st_mtime_ns for p in (Path(params.output.dir) / "shards").iterdir()}
    no_engine = EngineHolder(lambda settings: pytest.fail("a finished regeneration loaded a model"))
    again = stages.regenerate(params, engines=no_engine)
    assert again.reused and again.rows_written == 14
    stages.extract(params, engines=no_engine)
    assert {p.name: p.stat().st_mtime_ns for p in (Path(params.output.dir) / "shards").iterdir()} == shards


def test_greedy_rerun_gives_the_same_tokens_and_bytes_and_restores_a_lost_shard(one_pass, setup):
    """A lost shard cannot be prefilled under capture's settings (other bytes): extract refuses, and regenerate
    generates and captures again, giving the same token ids and the same shard bytes as the first time."""
    params = one_pass["params"]
    dataset = Path(params.output.dir)
    manifest = json.loads((dataset / layout.MANIFEST_FILE).read_text())
    before = {s["name"]: s["blake3"] for s in manifest["shards"]}
    samples_before = sha256_file(Path(params.regenerate.out) / "samples.parquet")
    layout.shard_path(dataset, manifest["shards"][1]["name"]).unlink()
    with pytest.raises(stages.MissingCapture, match="1 of .* shards are not on disk"):
        stages.extract(params, engines=setup["engines"])
    again = stages.regenerate(params.override({"output.overwrite": True}), engines=setup["engines"])
    assert not again.reused and again.shards_captured == len(before)
    assert sha256_file(Path(params.regenerate.out) / "samples.parquet") == samples_before
    stages.extract(params, engines=setup["engines"])
    after = json.loads((dataset / layout.MANIFEST_FILE).read_text())
    assert {s["name"]: s["blake3"] for s in after["shards"]} == before
    assert setup["counting"].created == 1  # one model load for every regeneration and extraction here


def test_truncated_turns_can_drop_their_conversation(setup):
    params = regenerate_params(setup["model"], setup["data"], setup["tmp"], "drop", capture=False,
                               on_truncated="drop")
    outcome = stages.regenerate(params, engines=setup["engines"])
    assert outcome.skipped_by_reason["truncated_turn"] > 0
    assert outcome.rows_read == outcome.rows_written + outcome.rows_skipped == 20
    samples, conversations = read_regenerated(Path(params.regenerate.out))
    assert all(c["truncated_turns"] == 0 for c in conversations)
    assert all(ids[-1] in {1, setup["stop"]} for ids in samples.input_ids)


def test_samples_captured_while_generating_are_held_as_copies_and_never_spilled(setup):
    """Their rows are copied out of each step (no pinned block is kept), so a host buffer too small for them
    spills nothing and refuses nothing, even with a codec (which a spilled sample cannot have)."""
    params = regenerate_params(setup["model"], setup["data"], setup["tmp"], "tiny-buffer").override(
        {"extract.host_buffer_gb": 0.0001, "extract.codec": "blosc2-zstd"})
    setup["engines"].close()  # the host buffer is the engine's: another one, and two do not fit this machine
    engines = EngineHolder()
    try:
        outcome = stages.regenerate(params, engines=engines)
        assert outcome.shards_captured > 0 and engines.engine.capture_stats().spilled_bytes == 0
        stages.extract(params, engines=engines)
    finally:
        engines.close()
    assert stages.validate(params).valid
