"""The core proof: states captured by the vLLM worker equal an independent Hugging Face reference (fp32).

One engine for the whole module; prompts from 1 token to several chunks with a
max_num_batched_tokens small enough to force chunked prefill, 16 requests in flight, identical prompts twice.
"""

import json

import pytest
import torch

from eagle_states.capture import protocol as p
from eagle_states.capture.engine import EngineHolder
from eagle_states.capture.protocol import SAMPLE_ID_KEY
from eagle_states.dataset.files import file_digest
from eagle_states.dataset.layout import LAYER_SEMANTICS, MANIFEST_FILE, shard_path
from eagle_states.dataset.reader import Dataset
from eagle_states.extraction.driver import Extraction, run_extraction
from helpers import extraction_params, hf_states, load_hf, random_prompts, rel_error, write_prompt_jsonl

LAYERS = [0, 2, 4, 5, 8]  # the embeddings, then the EAGLE-3 default of an 8-layer model
LENGTHS = [1, 2, 5, 17, 63, 64, 65, 130, 200, 257, 40, 40, 9, 100, 33, 3]


def settings(model, source, out, dtype):
    return extraction_params(model, source, out, layer_ids=LAYERS, dtype=dtype, shard_max_tokens=320,
                             max_model_len=512, max_num_batched_tokens=64, max_num_seqs=16,
                             gpu_memory_utilization=0.2)


@pytest.fixture(scope="module")
def engines():
    holder = EngineHolder()
    yield holder
    holder.close()


@pytest.fixture(scope="module")
def prompts():
    prompts = random_prompts(LENGTHS, 300, seed=1)
    prompts[11] = list(prompts[10])  # the same prompt twice
    return prompts


@pytest.fixture(scope="module")
def fp32_dataset(tmp_path_factory, llama_model, engines, prompts):
    tmp = tmp_path_factory.mktemp("fp32")
    source = write_prompt_jsonl(tmp / "prompts.jsonl", prompts)
    run_extraction(Extraction(settings(llama_model, source, tmp / "dataset", "float32")), progress=False,
                   engines=engines)
    return tmp / "dataset"


@pytest.fixture(scope="module")
def hf_fp32(llama_model):
    return load_hf(llama_model, torch.float32)


def test_layout_and_prompts(fp32_dataset, prompts):
    dataset = Dataset(fp32_dataset)
    assert dataset.manifest["layer_ids"] == LAYERS
    assert dataset.manifest["layer_semantics"] == LAYER_SEMANTICS
    assert len(dataset.manifest["shards"]) > 1
    assert dataset.sample_ids == [f"p{i:03d}" for i in range(len(prompts))]
    for sample, prompt in zip(dataset, prompts):
        assert sample.input_ids.tolist() == prompt
        assert sample.loss_mask.tolist() == [int(j % 3 != 2) for j in range(len(prompt))]
        assert len(sample.hidden_states) == len(LAYERS)
        assert all(t.shape == (len(prompt), 256) and t.dtype == torch.float32 for t in sample.hidden_states)


def test_fp32_matches_hf(fp32_dataset, prompts, hf_fp32):
    dataset = Dataset(fp32_dataset)
    worst = 0.0
    for sample, prompt in zip(dataset, prompts):
        reference = hf_states(hf_fp32, prompt, LAYERS)
        for j, k in enumerate(LAYERS):
            err = rel_error(sample.hidden_states[j], reference[j])
            assert err < 1e-5, f"{sample.sample_id} (T={len(prompt)}) layer {k}: relative error {err:.2e}"
            worst = max(worst, err)
    # The check can fail: the state of the neighbouring layer is far off (an off-by-one layer id shows).
    long_sample = dataset["p009"]
    shifted = hf_states(hf_fp32, prompts[9], [3])[0]
    assert rel_error(long_sample.hidden_states[1], shifted) > 0.05
    print(f"worst fp32 relative error {worst:.2e}")


def test_identical_prompts_give_identical_states(fp32_dataset):
    dataset = Dataset(fp32_dataset)
    a, b = dataset["p010"], dataset["p011"]
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))


def test_warmup_and_decode_rows_are_never_stored(tmp_path, llama_model, engines, fp32_dataset, hf_fp32):
    from vllm import SamplingParams

    engine = engines.engine
    prompt = random_prompts([70], 300, seed=7)[0]
    # A plain generation (no sample id), like a warm-up: the worker must record nothing.
    engine.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert engine.workers.call(p.Discard()).samples == []
    # A captured request that also decodes: only its 70 prompt rows may be stored.
    engine.llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(max_tokens=5, ignore_eos=True, extra_args={SAMPLE_ID_KEY: "decoding"}),
                        use_tqdm=False)
    path = tmp_path / "decode.safetensors"
    engine.workers.call(p.BeginShard(path=str(path), sample_ids=["decoding"], num_tokens=[70], loss_masks=[[1] * 70]))
    engine.workers.call(p.EndShard(path=str(path)))
    assert engine.workers.call(p.Poll(wait=True)).shards[str(path)].samples["decoding"][0] == 70
    from safetensors.torch import load_file

    tensors = load_file(path)
    assert tensors["decoding/input_ids"].tolist() == prompt
    reference = hf_states(hf_fp32, prompt, LAYERS)
    for j in range(len(LAYERS)):
        assert tensors[f"decoding/hidden_states/{j}"].shape == (70, 256)
        assert rel_error(tensors[f"decoding/hidden_states/{j}"], reference[j]) < 1e-5


def test_a_shard_given_up_half_way_leaves_no_file_and_a_clean_engine(tmp_path, llama_model, engines, fp32_dataset,
                                                                     hf_fp32):
    """A shard's file is written as its samples are captured; when the driver gives up on the shard half-way
    (the engine failed under it), the half-written temp file goes and the next shard is captured normally."""
    import time

    from vllm import SamplingParams

    engine = engines.engine
    first, second = random_prompts([90, 30], 300, seed=11)
    path = tmp_path / "given-up.safetensors"
    engine.workers.call(p.BeginShard(path=str(path), sample_ids=["a", "b"], num_tokens=[90, 30],
                             loss_masks=[[1] * 90, [1] * 30]))
    engine.llm.generate([{"prompt_token_ids": first}],
                        SamplingParams(max_tokens=1, extra_args={SAMPLE_ID_KEY: "a"}), use_tqdm=False)
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob(".given-up.safetensors.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(tmp_path.glob(".given-up.safetensors.*.tmp")), "the writer did not start on the captured sample"
    engine.reset()  # "b" never comes
    assert list(tmp_path.iterdir()) == []
    again = tmp_path / "again.safetensors"
    engine.workers.call(p.BeginShard(path=str(again), sample_ids=["b"], num_tokens=[30], loss_masks=[[1] * 30]))
    engine.llm.generate([{"prompt_token_ids": second}],
                        SamplingParams(max_tokens=1, extra_args={SAMPLE_ID_KEY: "b"}), use_tqdm=False)
    engine.workers.call(p.EndShard(path=str(again)))
    report = engine.workers.call(p.Poll(wait=True)).shards[str(again)]
    assert report.digest == file_digest(again) and report.samples["b"][0] == 30
    from safetensors.torch import load_file

    tensors = load_file(again)
    reference = hf_states(hf_fp32, second, LAYERS)
    assert [p.name for p in tmp_path.iterdir()] == ["again.safetensors"]
    for j in range(len(LAYERS)):
        assert rel_error(tensors[f"b/hidden_states/{j}"], reference[j]) < 1e-5


def test_rerun_resumes_only_unfinished_shards(tmp_path, llama_model, engines, prompts, fp32_dataset):
    import shutil

    out = tmp_path / "dataset"
    shutil.copytree(fp32_dataset, out)
    source = write_prompt_jsonl(tmp_path / "prompts.jsonl", prompts)
    before = json.loads((out / MANIFEST_FILE).read_text())
    shard_path(out, "shard-00001").unlink()  # lost
    with open(shard_path(out, "shard-00002"), "r+b") as f:  # changed after it was written
        f.seek(200)
        f.write(b"\0\0\0\0")
    extraction = Extraction(settings(llama_model, source, out, "float32"))
    computed = []
    after = extraction.run(engines, lambda shard, cached: computed.append(shard.name) if not cached else None)
    assert computed == ["shard-00001", "shard-00002"]
    assert [s["blake3"] for s in after["shards"]] == [s["blake3"] for s in before["shards"]]
    assert after == before


def test_a_finished_dataset_made_differently_is_not_replaced_unless_asked(tmp_path, llama_model, prompts,
                                                                          fp32_dataset):
    from eagle_states.extraction.driver import DatasetExists

    source = write_prompt_jsonl(tmp_path / "prompts.jsonl", prompts)
    Extraction(settings(llama_model, source, fp32_dataset, "float32"))  # the same extraction again: a rerun
    other_layers = settings(llama_model, source, fp32_dataset, "float32").override({"extract.layer_ids": [1, 3]})
    with pytest.raises(DatasetExists, match=r"layer_ids: \[0, 2, 4, 5, 8\] there, \[1, 3\] now.*--overwrite"):
        Extraction(other_layers)
    fewer = write_prompt_jsonl(tmp_path / "fewer.jsonl", prompts[:3])
    with pytest.raises(DatasetExists, match="input_sha256"):
        Extraction(settings(llama_model, fewer, fp32_dataset, "float32"))
    assert len(Extraction(other_layers.override({"output.overwrite": True})).shards) > 0
