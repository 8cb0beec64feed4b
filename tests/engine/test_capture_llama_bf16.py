"""bf16 engine: within twice Hugging Face's own bf16-vs-fp32 error, on the prompts of the fp32 test."""

import pytest
import torch

from eagle_states.dataset.reader import Dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from helpers import hf_states, load_hf, rel_error, write_prompt_jsonl
from test_capture_llama import LAYERS, prompts, settings  # noqa: F401  (prompts is a fixture)


@pytest.fixture(scope="module")
def bf16_dataset(tmp_path_factory, llama_model, prompts):
    tmp = tmp_path_factory.mktemp("bf16")
    source = write_prompt_jsonl(tmp / "prompts.jsonl", prompts)
    run_extraction(Extraction(settings(llama_model, source, tmp / "dataset", "bfloat16")), progress=False)
    return tmp / "dataset"


def test_bf16_within_twice_hf_own_bf16_error(bf16_dataset, prompts, llama_model):
    hf_fp32 = load_hf(llama_model, torch.float32)
    hf_bf16 = load_hf(llama_model, torch.bfloat16)
    dataset = Dataset(bf16_dataset)
    assert dataset.manifest["dtype"] == "bfloat16"
    for sample, prompt in zip(dataset, prompts):
        if len(prompt) < 16:  # relative errors of a handful of rows say little
            continue
        exact = hf_states(hf_fp32, prompt, LAYERS)
        hf_own = hf_states(hf_bf16, prompt, LAYERS)
        for j, k in enumerate(LAYERS[1:], start=1):
            assert sample.hidden_states[j].dtype == torch.bfloat16
            ours, theirs = rel_error(sample.hidden_states[j], exact[j]), rel_error(hf_own[j], exact[j])
            assert ours <= 2 * theirs + 1e-3, f"{sample.sample_id} layer {k}: {ours:.3e} vs HF bf16 {theirs:.3e}"
