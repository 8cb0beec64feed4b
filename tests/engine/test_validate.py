"""Validation names each corruption the seed and the peers' bug reports describe, read from the files."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eagle_states.cli import main as cli
from eagle_states.dataset.layout import shard_path
from eagle_states.dataset.manifest import read_manifest
from eagle_states.dataset.shard_file import write_shard_file
from eagle_states.extraction.driver import Extraction, run_extraction
from eagle_states.validate import validate_dataset
from helpers import extraction_params, random_prompts, write_prompt_jsonl


@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("valid")
    source = write_prompt_jsonl(tmp / "prompts.jsonl", random_prompts([5, 17, 40, 3, 64, 9], 300, seed=5))
    params = extraction_params(llama_model, source, tmp / "dataset", dtype="float32", shard_max_tokens=70,
                               max_model_len=256, max_num_batched_tokens=35, max_num_seqs=16,
                               gpu_memory_utilization=0.2)
    run_extraction(Extraction(params), progress=False)
    dataset = tmp / "dataset"
    assert [s["num_samples"] for s in read_manifest(dataset)["shards"]] == [4, 1, 1]  # p000-p003, p004, p005
    return dataset


@pytest.fixture
def copy(tmp_path, good_dataset):
    out = tmp_path / "dataset"
    shutil.copytree(good_dataset, out)
    return out


def rewrite(dataset, shard, change, update_manifest=True):
    """Apply `change` to a shard's tensors and rewrite it; keep the manifest's hash in step unless told not to."""
    path = shard_path(dataset, shard)
    tensors = load_file(path)
    change(tensors)
    digest, size = write_shard_file(path, tensors)
    if update_manifest:
        manifest = json.loads((dataset / "manifest.json").read_text())
        for s in manifest["shards"]:
            if s["name"] == shard:
                s["blake3"], s["bytes"] = digest, size
        (dataset / "manifest.json").write_text(json.dumps(manifest))


def checks(result):
    """(sample or shard, slot, check) per failure; the layer id beside each slot must be the manifest's."""
    for row in result.failures.itertuples():
        if row.slot != "":
            assert row.layer_id == ([2, 4, 5, 8][row.slot] if row.slot < 4 else "")
    return {(row.sample_id, str(row.slot), row.check) for row in result.failures.itertuples()}


def test_a_correct_dataset_is_valid(good_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml, no work/prepared here: the dataset alone is validated
    result = validate_dataset(good_dataset, min_loss_tokens=1)
    assert result.valid, result.failures
    assert result.summary["samples"] == 6 and result.summary["layers"] == [2, 4, 5, 8]
    assert result.summary["tokens"] == 5 + 17 + 40 + 3 + 64 + 9
    assert cli(["validate", str(good_dataset), "--report", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["valid"]


def test_layer_replaced_by_its_first_row(copy):
    rewrite(copy, "shard-00000", lambda t: t.update({"p000/hidden_states/1": t["p000/hidden_states/1"][0]}))
    result = validate_dataset(copy)
    assert not result.valid
    assert ("p000", "1", "equal_to(2)") in {(s, l, c.replace("ndim: ", "")) for s, l, c in checks(result)}


def test_list_replaced_by_one_layers_tensor(copy):
    def seed_bug(t):
        first = t["p001/hidden_states/0"]
        for j in range(4):
            del t[f"p001/hidden_states/{j}"]
        t["p001/hidden_states"] = first
    rewrite(copy, "shard-00000", seed_bug)
    result = validate_dataset(copy)
    found = checks(result)
    assert any(s == "p001" and "num_slots" in c for s, _, c in found)
    assert any("key" in c for _, _, c in found)  # the stray key is named too


def test_three_layers_where_four_are_declared(copy):
    rewrite(copy, "shard-00000", lambda t: t.pop("p001/hidden_states/3"))
    found = checks(validate_dataset(copy))
    assert any(s == "p001" and "num_slots" in c for s, _, c in found)


def test_one_row_more_than_the_ids(copy):
    rewrite(copy, "shard-00000", lambda t: t.update(
        {"p000/hidden_states/2": torch.cat([t["p000/hidden_states/2"], t["p000/hidden_states/2"][:1]])}))
    found = checks(validate_dataset(copy))
    assert ("p000", "2", "tokens_equal_input_ids") in found


def test_a_nan(copy):
    def nan(t):
        t["p002/hidden_states/3"][4, 7] = float("nan")
    rewrite(copy, "shard-00000", nan)
    assert any(s == "p002" and l == "3" and "nan" in c for s, l, c in checks(validate_dataset(copy)))


def test_wrong_dtype(copy):
    rewrite(copy, "shard-00000", lambda t: t.update({"p000/hidden_states/0": t["p000/hidden_states/0"].half()}))
    assert any(s == "p000" and l == "0" and "dtype" in c for s, l, c in checks(validate_dataset(copy)))


def test_a_missing_and_a_duplicated_sample(copy):
    def move(t):
        for key in [k for k in t if k.startswith("p000/")]:
            t[key.replace("p000/", "p004/")] = t.pop(key)
    rewrite(copy, "shard-00000", move)  # p000 is gone; p004 is now in two shards
    found = checks(validate_dataset(copy))
    assert ("p000", "", "occurrences: equal_to(1)") in found  # missing: found 0 times
    assert ("p004", "", "occurrences: equal_to(1)") in found  # duplicated


def test_a_shard_changed_after_the_manifest(copy):
    def scale(t):
        t["p000/hidden_states/0"] *= 1.0001
    rewrite(copy, "shard-00000", scale, update_manifest=False)
    assert ("shard-00000", "", "digest_matches: equal_to(True)") in checks(validate_dataset(copy))


def test_a_truncated_shard(copy, monkeypatch):
    monkeypatch.chdir(copy.parent)
    path = shard_path(copy, "shard-00001")
    path.write_bytes(path.read_bytes()[:-1000])
    result = validate_dataset(copy)
    found = checks(result)
    assert any(s == "shard-00001" and "readable" in c for s, _, c in found)
    assert ("p004", "", "occurrences: equal_to(1)") in found  # its sample is missing
    assert cli(["validate", str(copy), "--report", str(copy.parent / "validation.json")]) == 1
    assert (copy.parent / "validation_failures.csv").exists()


def test_a_token_id_outside_the_vocabulary_and_too_few_loss_tokens(copy):
    def change(t):
        t["p003/input_ids"][0] = 10 ** 6
        t["p003/loss_mask"].zero_()
    rewrite(copy, "shard-00000", change)
    found = checks(validate_dataset(copy, min_loss_tokens=1))
    assert any(s == "p003" and "ids_max" in c for s, _, c in found)
    assert any(s == "p003" and "loss_tokens" in c for s, _, c in found)


def test_cannot_run_is_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: config's defaults
    assert cli(["validate", str(tmp_path / "nothing"), "--report", str(tmp_path / "v.json")]) == 2


def test_a_valid_dataset_is_not_read_again_until_one_of_its_files_changes(copy):
    import os

    assert validate_dataset(copy).summary["reused"] is False
    again = validate_dataset(copy)
    assert again.valid and again.summary["reused"] is True
    assert validate_dataset(copy, min_loss_tokens=2).summary["reused"] is False, "other settings: validated again"
    shard = shard_path(copy, "shard-00001")
    with open(shard, "r+b") as f:  # a byte changed behind the manifest's back: the write moves the file's time
        f.seek(shard.stat().st_size - 3)
        f.write(b"\xff")
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    result = validate_dataset(copy)
    assert not result.valid and result.summary["reused"] is False
