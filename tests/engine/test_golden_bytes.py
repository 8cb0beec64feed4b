"""Golden bytes: a fixed model and prompt set extracted in fp32 (chunked prefill, mixed lengths, uncompressed and
with a codec) and bf16 must give exactly the shards pinned here. A change that alters them without raising
`CAPTURE_FORMAT_VERSION` (eagle_states/dataset/capture_format.py) fails here; a change that alters nothing else
(a comment, a rename) keeps every finished shard, because the shard cache key is made of declared things only.

The pinned values were made by the release before the capture format was declared (4c5ab97), so the same test
shows that its datasets are reused whole: its receipts' keys are accepted and no model is loaded."""

import json
import shutil

import pytest

from eagle_states.capture.engine import EngineHolder
from eagle_states.dataset.manifest import read_manifest
from eagle_states.extraction.driver import Extraction, run_extraction
from helpers import CountingEngines, extraction_params, random_prompts, write_prompt_jsonl

# prompts of 3..190 tokens in steps of 64 tokens: most span several steps (chunked prefill), steps mix requests
LENGTHS = [37, 190, 3, 64, 129, 70, 11, 150]
SETTINGS = dict(shard_max_tokens=256, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
                gpu_memory_utilization=0.2)
# (dtype, codec): the shards' sha256 (first 16 hex digits), and the receipts' key as the 4c5ab97 release wrote it
GOLDEN = {
    ("float32", "none"): (["62fc89787411c98f", "34c0cba578190cc8", "96083b628a8166a4"],
                          "bc3693fba7163af8ec271c14905d828744eea5328aa8266b11726d118234a241"),
    ("float32", "blosc2-zstd"): (["4c566da45dbba96f", "01dd02b63a96450c", "bcce02b45652dbcc"],
                                 "2d05deb93c290d7d7dfb72e2395799878cf37d9713bc73d66daa94c7e1759b3c"),
    ("bfloat16", "none"): (["664aef59626bb751", "2582266ae208ea16", "164dad10f3b800e5"],
                           "30503b4332a7d2a1e1bb60af6ff6c973338d5afa851e7f38e3ecc725565086b9"),
}


def params_for(llama_model, prompts, out, dtype, codec):
    return extraction_params(llama_model, prompts, out, dtype=dtype, codec=codec, **SETTINGS)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, llama_model):
    """Every (dtype, codec) of GOLDEN extracted once: one engine per dtype (the codec is a shard's, not the
    engine's)."""
    tmp = tmp_path_factory.mktemp("golden")
    prompts = write_prompt_jsonl(tmp / "prompts.jsonl", random_prompts(LENGTHS, 500, seed=11))
    for dtype in ("float32", "bfloat16"):
        engines = EngineHolder()
        try:
            for (want_dtype, codec) in GOLDEN:
                if want_dtype == dtype:
                    run_extraction(Extraction(params_for(llama_model, prompts, tmp / f"{dtype}-{codec}", dtype, codec)),
                                   progress=False, engines=engines)
        finally:
            engines.close()
    return tmp, prompts


@pytest.mark.parametrize("dtype, codec", list(GOLDEN))
def test_the_capture_writes_the_pinned_bytes(extracted, dtype, codec):
    manifest = read_manifest(extracted[0] / f"{dtype}-{codec}")
    assert [s["sha256"][:16] for s in manifest["shards"]] == GOLDEN[(dtype, codec)][0], (
        f"{dtype}/{codec}: the shard bytes changed; if that is meant, raise CAPTURE_FORMAT_VERSION and pin the new "
        "hashes")


@pytest.mark.parametrize("dtype, codec", list(GOLDEN))
def test_a_dataset_of_the_release_before_the_declared_format_is_reused_whole(extracted, llama_model, tmp_path,
                                                                             dtype, codec):
    """Its receipts carry the old key (a hash of the capture's source text): written back as that release wrote
    them, they are honoured, and the extraction loads no model."""
    tmp, prompts = extracted
    out = shutil.copytree(tmp / f"{dtype}-{codec}", tmp_path / "ds")
    for receipt in (out / "receipts").glob("*.json"):
        record = json.loads(receipt.read_text())
        record["config_hash"] = GOLDEN[(dtype, codec)][1]
        del record["engine"]  # that release did not record the engine
        receipt.write_text(json.dumps(record))
    (out / "manifest.json").unlink()
    engines = CountingEngines()
    run_extraction(Extraction(params_for(llama_model, prompts, out, dtype, codec)), progress=False,
                   engines=EngineHolder(engines))
    assert engines.created == 0
    assert [s["sha256"][:16] for s in read_manifest(out)["shards"]] == GOLDEN[(dtype, codec)][0]
