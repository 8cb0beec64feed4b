"""Tensor parallel extraction on the CPU build (one core per rank)."""

import pytest
import torch

from eagle_states.dataset.reader import Dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from helpers import extraction_params, random_prompts, write_prompt_jsonl

PROMPTS = random_prompts([1, 9, 40, 64, 65, 130, 17, 3], 300, seed=11)


def settings(model, source, out, layers, tp=1):
    return extraction_params(model, source, out, layer_ids=layers, dtype="float32", shard_max_tokens=128,
                             max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                             gpu_memory_utilization=0.15, tensor_parallel_size=tp)


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
