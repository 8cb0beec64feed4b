"""Tensor and data parallel extraction on the CPU build (one core per rank or engine)."""

import pytest
import torch

from eagle_states.dataset.manifest import read_manifest
from eagle_states.dataset.reader import Dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from eagle_states.parallel import run_data_parallel
from helpers import extraction_params, random_prompts, write_prompt_jsonl

PROMPTS = random_prompts([1, 9, 40, 64, 65, 130, 17, 3], 300, seed=11)


def settings(model, source, out, layers, tp=1, dp=1):
    return extraction_params(model, source, out, layer_ids=layers, dtype="float32", shard_max_tokens=128,
                             max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                             gpu_memory_utilization=0.15, tensor_parallel_size=tp, data_parallel_size=dp)


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_tp2_equals_tp1(tmp_path, llama_model, deepseek_model, monkeypatch, arch):
    model, layers = (llama_model, [0, 2, 4, 5, 8]) if arch == "llama" else (deepseek_model, [0, 1, 2, 4])
    source = write_prompt_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    run_extraction(Extraction(settings(model, source, tmp_path / "tp1", layers)), progress=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    run_extraction(Extraction(settings(model, source, tmp_path / "tp2", layers, tp=2)), progress=False)
    tp1, tp2 = Dataset(tmp_path / "tp1"), Dataset(tmp_path / "tp2")
    assert tp1.sample_ids == tp2.sample_ids
    for a, b in zip(tp1, tp2):
        assert torch.equal(a.input_ids, b.input_ids) and len(b.hidden_states) == len(layers)
        for j, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states)):
            err = (torch.linalg.norm(x - y) / torch.linalg.norm(x)).item()
            assert err < 1e-5, f"{a.sample_id} layer {layers[j]}: TP=2 differs from TP=1 by {err:.2e}"


def test_two_engines_write_the_same_dataset_as_one(tmp_path, llama_model, monkeypatch):
    source = write_prompt_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # both runs compute with one core per engine
    run_extraction(Extraction(settings(llama_model, source, tmp_path / "one", "eagle3")), progress=False)
    run_data_parallel(settings(llama_model, source, tmp_path / "two", "eagle3", dp=2))
    one, two = (read_manifest(tmp_path / d) for d in ("one", "two"))
    assert len(one["shards"]) >= 4
    assert [s["sha256"] for s in two["shards"]] == [s["sha256"] for s in one["shards"]]
    assert (tmp_path / "two" / "manifest.json").read_bytes() == (tmp_path / "one" / "manifest.json").read_bytes()
    assert (tmp_path / "two" / "index.parquet").read_bytes() == (tmp_path / "one" / "index.parquet").read_bytes()
