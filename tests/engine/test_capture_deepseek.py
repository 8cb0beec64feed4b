"""The seed's architecture (DeepseekV3ForCausalLM: MLA, MoE after a dense first layer) against HF, fp32.

vLLM turns chunked prefill and prefix caching off by itself for MLA on the CPU build; lengths still vary and
16 requests are in flight.
"""

import pytest
import torch

from eagle_states.dataset.reader import Dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from helpers import extraction_params, hf_states, load_hf, random_prompts, rel_error, write_prompt_jsonl

LAYERS = [0, 1, 2, 4]  # embeddings, after the dense layer, after the first MoE layer, final pre-norm state


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, deepseek_model):
    tmp = tmp_path_factory.mktemp("dsv3")
    prompts = random_prompts([1, 3, 17, 64, 65, 130, 40, 40, 9, 100, 33, 250, 5, 77, 12, 2], 300, seed=3)
    source = write_prompt_jsonl(tmp / "prompts.jsonl", prompts)
    params = extraction_params(deepseek_model, source, tmp / "dataset", layer_ids=LAYERS, dtype="float32",
                               shard_max_tokens=512, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=16,
                               gpu_memory_utilization=0.2)
    run_extraction(Extraction(params), progress=False)
    return tmp / "dataset", prompts


def test_deepseek_v3_fp32_matches_hf(dataset, deepseek_model):
    path, prompts = dataset
    data = Dataset(path)
    assert data.manifest["model"]["architecture"] == "DeepseekV3ForCausalLM"
    hf = load_hf(deepseek_model, torch.float32)
    for sample, prompt in zip(data, prompts):
        assert sample.input_ids.tolist() == prompt
        reference = hf_states(hf, prompt, LAYERS)
        for j, k in enumerate(LAYERS):
            assert sample.hidden_states[j].shape == (len(prompt), 256)
            err = rel_error(sample.hidden_states[j], reference[j])
            assert err < 1e-5, f"{sample.sample_id} (T={len(prompt)}) layer {k}: relative error {err:.2e}"
