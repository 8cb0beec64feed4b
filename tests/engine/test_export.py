"""Exports read back by the trainers' own code (speculators) or by a reader following SpecForge's published
loader, bit for bit; refusals; resume."""

import json

import pytest
import torch

from eagle_states.dataset.files import sha256_file
from eagle_states.dataset.reader import Dataset
from eagle_states.export import ExportRefused, export_dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from eagle_states.validate import validate_dataset
from helpers import extraction_params, random_prompts, write_prompt_jsonl


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("export")
    source = write_prompt_jsonl(tmp / "prompts.jsonl", random_prompts([5, 17, 40, 3, 64, 9, 120], 300, seed=9))
    params = extraction_params(llama_model, source, tmp / "dataset", dtype="float32", shard_max_tokens=100,
                               max_model_len=256, max_num_batched_tokens=50, max_num_seqs=16,
                               gpu_memory_utilization=0.2)
    run_extraction(Extraction(params), progress=False)
    assert validate_dataset(tmp / "dataset", report=tmp / "validation.json").valid
    return tmp / "dataset", tmp / "validation.json"


def test_speculators_reads_our_export_with_its_own_loader(dataset, tmp_path):
    from speculators.train.data import ArrowDataset, CollateFn

    path, report = dataset
    info = export_dataset(path, tmp_path / "spec", "speculators", progress=False)
    assert info["manifest_sha256"] == sha256_file(path / "manifest.json")
    ours = Dataset(path)
    theirs = ArrowDataset(max_len=512, datapath=tmp_path / "spec", on_missing="raise",
                          hidden_states_dtype=torch.float32)
    assert len(theirs) == len(ours)
    items = []
    for i, sid in enumerate(ours.sample_ids):
        item, sample = theirs[i], ours[sid]
        assert torch.equal(item["input_ids"], sample.input_ids.long())
        assert torch.equal(item["loss_mask"].long(), sample.loss_mask.long())
        assert torch.equal(item["hidden_states"], torch.cat(sample.hidden_states[:-1], dim=-1))  # aux, in order
        assert torch.equal(item["verifier_last_hidden_states"], sample.hidden_states[-1])  # the final state
        items.append(item)
    batch = CollateFn(max_len=512, hidden_size=256, num_target_layers=3, dtype=torch.float32)(items[:3])
    n = sum(len(ours[sid].input_ids) for sid in ours.sample_ids[:3])
    assert torch.equal(batch["hidden_states"][0, :n], torch.cat([items[k]["hidden_states"] for k in range(3)]))
    freq = torch.load(tmp_path / "spec" / "token_freq.pt")
    assert sum(freq.values()) == ours.manifest["num_loss_tokens"]


def test_speculators_own_trainer_builds_its_draft_from_our_export(dataset, tmp_path, llama_model):
    """The command the acceptance harness runs on a GPU (`speculators train`, acceptance.speculators_trainer), in
    speculators' own --dry-run, which runs on this CPU: it reads our export, takes the export's layer ids (not its
    default [2, n//2, n-3]) and our token frequencies, and saves the draft vLLM serves."""
    import os
    import subprocess

    from safetensors.torch import load_file
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    from eagle_states.acceptance.draft import DraftRecipe
    from eagle_states.acceptance.speculators_trainer import train_command

    path, _ = dataset
    export = tmp_path / "spec"
    export_dataset(path, export, "speculators", progress=False)
    recipe = DraftRecipe()
    done = subprocess.run([*train_command(export, llama_model, tmp_path / "run", recipe), "--dry-run"],
                          env={**os.environ, "EAGLE_STATES_METRICS": str(tmp_path / "metrics.jsonl")},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = tmp_path / "run" / "checkpoints"
    config = json.loads((saved / "config.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"][:-1]
    assert config["transformer_layer_config"]["layer_types"] == ["full_attention"] * recipe.num_layers
    assert (config["norm_before_residual"], config["norm_before_fc"], config["norm_output"]) == (True, True, True)
    assert config["draft_vocab_size"] == recipe.draft_vocab_size
    weights = load_file(saved / "model.safetensors")
    d2t, t2d = build_vocab_mappings_from_distribution(torch.load(export / "token_freq.pt", weights_only=True),
                                                      recipe.draft_vocab_size,
                                                      AutoConfig.from_pretrained(llama_model).vocab_size)
    assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)


def load_specforge_file(path):
    """Reads a file the way SpecForge's OfflineEagle3Dataset does (torch.load; aux_hidden_state squeezed to
    [T, (L-1)H] is the draft input, hidden_state squeezed to [T, H] the target)."""
    data = torch.load(path, weights_only=False, mmap=True)
    return {"hidden_state": data["aux_hidden_state"].squeeze(0), "target": data["hidden_state"].squeeze(0),
            "input_ids": data["input_ids"], "loss_mask": data["loss_mask"]}


@pytest.mark.parametrize("fmt", ["specforge", "speculators-legacy"])
def test_round_trip(dataset, tmp_path, fmt):
    path, report = dataset
    out = tmp_path / fmt
    export_dataset(path, out, fmt, progress=False)
    ours = Dataset(path)
    for i, sid in enumerate(ours.sample_ids):
        sample = ours[sid]
        if fmt == "specforge":
            files = list(out.glob(f"rows_*/data_{i}.ckpt"))
            assert len(files) == 1
            got = load_specforge_file(files[0])
            assert torch.equal(got["target"], sample.hidden_states[-1])
            assert torch.equal(got["hidden_state"], torch.cat(sample.hidden_states[:-1], dim=-1))
        else:
            got = torch.load(out / f"data_{i}.pt")
            assert len(got["hidden_states"]) == 4
            assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], sample.hidden_states))
        assert torch.equal(got["input_ids"], sample.input_ids.long())
        assert torch.equal(got["loss_mask"], sample.loss_mask.long())


def test_an_interrupted_export_resumes(dataset, tmp_path):
    path, report = dataset
    out = tmp_path / "legacy"
    export_dataset(path, out, "speculators-legacy", progress=False)
    (out / "data_2.pt").unlink()
    (out / "data_5.pt").unlink()
    (out / "export.json").unlink()  # as if killed before the end
    assert export_dataset(path, out, "speculators-legacy", progress=False)["written_this_run"] == 2


def test_refusals(dataset, tmp_path, llama_model):
    path, report = dataset
    source = write_prompt_jsonl(tmp_path / "p.jsonl", random_prompts([5, 7], 300))
    params = extraction_params(llama_model, source, tmp_path / "no-final", layer_ids=[0, 2, 4], dtype="float32",
                               max_model_len=64, gpu_memory_utilization=0.2)
    run_extraction(Extraction(params), progress=False)
    with pytest.raises(ExportRefused, match="has not passed validation"):
        export_dataset(tmp_path / "no-final", tmp_path / "x", "speculators", progress=False)
    # validated with the same report path as the main dataset: each dataset keeps its own validation state
    assert validate_dataset(tmp_path / "no-final", report=report).valid
    export_dataset(path, tmp_path / "main", "speculators-legacy", progress=False)
    for fmt in ("speculators", "specforge"):
        with pytest.raises(ExportRefused, match="final state"):
            export_dataset(tmp_path / "no-final", tmp_path / fmt, fmt, progress=False)
    export_dataset(tmp_path / "no-final", tmp_path / "legacy", "speculators-legacy", progress=False)
    assert json.loads((tmp_path / "legacy" / "export.json").read_text())["layer_ids"] == [0, 2, 4]
