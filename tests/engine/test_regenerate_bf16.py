"""bf16: states captured while generating are within twice Hugging Face's own bf16 error (against HF in fp32) for
the final token ids, on the conversations of the fp32 test (14 of mixed lengths and turns, chunked prefill)."""

from pathlib import Path

import pandas as pd
import pytest
import torch

from eagle_states import stages
from eagle_states.capture.engine import EngineHolder
from eagle_states.dataset.reader import Dataset
from helpers import hf_states, load_hf, rel_error
from test_regenerate import LAYERS, conversation_rows, regenerate_params, write_rows


@pytest.fixture(scope="module")
def bf16_one_pass(tmp_path_factory, llama_model):
    tmp = tmp_path_factory.mktemp("regenerate-bf16")
    data = write_rows(tmp / "conversations.jsonl", conversation_rows())
    params = regenerate_params(llama_model, data, tmp, "bf16", max_new_tokens=16)
    params = params.override({"extract.dtype": "bfloat16"})
    engines = EngineHolder()
    try:
        outcome = stages.regenerate(params, engines=engines)
        stages.extract(params, engines=engines)
    finally:
        engines.close()
    assert outcome.rows_written == 14 and outcome.shards_captured > 1
    return params


def test_bf16_states_captured_while_generating_within_twice_hf_own_bf16_error(bf16_one_pass, llama_model):
    params = bf16_one_pass
    hf_fp32, hf_bf16 = load_hf(llama_model, torch.float32), load_hf(llama_model, torch.bfloat16)
    dataset = Dataset(Path(params.output.dir))
    assert dataset.manifest["dtype"] == "bfloat16" and dataset.manifest["engine"]["regenerate.capture"] is True
    samples = pd.read_parquet(Path(params.regenerate.out) / "samples.parquet")
    compared = 0
    for sample, prepared in zip(dataset, samples.itertuples()):
        ids = list(prepared.input_ids)
        assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == list(prepared.loss_mask)
        if len(ids) < 16:  # relative errors of a handful of rows say little
            continue
        exact, hf_own = hf_states(hf_fp32, ids, LAYERS), hf_states(hf_bf16, ids, LAYERS)
        for j, k in enumerate(LAYERS[1:], start=1):
            assert sample.hidden_states[j].dtype == torch.bfloat16
            ours, theirs = rel_error(sample.hidden_states[j], exact[j]), rel_error(hf_own[j], exact[j])
            assert ours <= 2 * theirs + 1e-3, f"{sample.sample_id} layer {k}: {ours:.3e} vs HF bf16 {theirs:.3e}"
        compared += 1
    assert compared >= 12
