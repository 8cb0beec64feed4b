"""Golden bytes: a fixed model and prompt set extracted in fp32 (chunked prefill, mixed lengths, uncompressed and
with the codecs Blosc2 and fp8-e4m3) and bf16 must give shards whose bytes *our code decides* are the ones pinned
here: the header (every key, dtype, shape, and where the uncompressed tensors lie), the metadata's fields, the
logical dtype and shape of every compressed tensor (and so fp8's stored size: its framing), and the token ids' and
loss masks' bytes, and where a compressed shard's tensors start (its header's room). A change that alters them
without raising
`CAPTURE_FORMAT_VERSION` (eagle_states/dataset/capture_format.py) fails here. The states' values are the engine's
numerics, which differ between CPUs (this machine's AMX rounds bf16 otherwise than the machines before it), so
they are not pinned: the Hugging Face comparisons hold them (tests/engine/test_capture_llama*.py).

The uncompressed values were made by the release before the capture format was declared (4c5ab97; its shards and
ours were also byte-identical on this machine), and that release's uncompressed datasets are reused whole: its
receipts' keys are accepted and no model is loaded. The compressed ones are format 2's (the header's room)."""

import hashlib
import json
import shutil
import struct

import pytest

from eagle_states.capture.engine import EngineHolder
from eagle_states.dataset.capture_format import CAPTURE_CODE_HASHES_OF_FORMAT_1
from eagle_states.dataset.codec import CODEC_KEY, ENCODED_KEY
from eagle_states.dataset.files import sha256_file
from eagle_states.dataset.layout import shard_path
from eagle_states.dataset.manifest import read_manifest
from eagle_states.dataset.shard_file import ShardReader
from eagle_states.extraction.driver import Extraction, run_extraction
from eagle_states.validate import validate_dataset
from helpers import CountingEngines, extraction_params, random_prompts, write_prompt_jsonl

# prompts of 3..190 tokens in steps of 64 tokens: most span several steps (chunked prefill), steps mix requests
LENGTHS = [37, 190, 3, 64, 129, 70, 11, 150]
SETTINGS = dict(shard_max_tokens=256, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
                gpu_memory_utilization=0.2)
# (dtype, codec): what our code decides in each shard (`decided_by_us`)
GOLDEN = {  # (digests of `decided_by_us` since 2026-12-03, when it stopped reading Blosc2's output lengths: the
    # shards' bytes did not change, the three that passed before on this CPU passed with the old digests too)
    ("float32", "none"): ["8772a0430e84d296", "3516bcf346aa9fb7", "3f2bbd055dadf18a"],
    ("float32", "blosc2-zstd"): ["0d0ced5485cf5908", "c52aaa53f58cfa27", "1f5237521530181e"],  # format 2
    ("bfloat16", "none"): ["8d683337bf1fbe16", "b00cf6e412e72ef3", "d5e4548de6680036"],
    ("float32", "fp8-e4m3"): ["a4b66dd4b2a6192c", "d213ad67aa3d327b", "1f8eace80c1d68b8"],  # format 2
}
# what the release before the declared format could write (fp8-e4m3 came after it)
RELEASED_BEFORE_THE_FORMAT = [key for key in GOLDEN if key[1] != "fp8-e4m3"]
# the receipts' key as the 4c5ab97 release wrote it for float32/none, where the demo model's weights are these
# (its bytes come from torch's CPU generator); elsewhere the key is checked through the formula alone
LEGACY_KEY = ("155d2adca506208c24581ffc19378c067a26c3c2b23ea5547ee6783891372fcb",
              "bc3693fba7163af8ec271c14905d828744eea5328aa8266b11726d118234a241")


def decided_by_us(path) -> str:
    """A digest of a shard's bytes that our code decides, not the engine's numerics."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    metadata = header.pop("__metadata__", None) or {}
    encoded = json.loads(metadata.get(ENCODED_KEY, "{}"))
    # an entropy coder's stored length is its output on the engine's numbers (which differ between CPUs, as the
    # states do), and so are the offsets of what follows it: ours are the tensors' order in the file, their dtypes,
    # and the lengths and shapes of those stored as they are or as fp8 codes
    entropy_coded = json.loads(metadata.get(CODEC_KEY, "{}")).get("name", "none") not in ("none", "fp8-e4m3")
    order = sorted(header, key=lambda key: header[key]["data_offsets"][0])
    layout = {key: {"dtype": v["dtype"]} if key in encoded and entropy_coded else
              {"dtype": v["dtype"], "shape": v["shape"], "bytes": v["data_offsets"][1] - v["data_offsets"][0]}
              for key, v in sorted(header.items())}
    layout["order"] = order
    logical = {key: {"dtype": e["dtype"], "shape": e["shape"]} for key, e in sorted(encoded.items())}
    decided = [layout, logical, sorted(k for k in metadata if k != ENCODED_KEY)]
    if encoded:  # where a compressed shard's tensors start: its header's room (format 2)
        decided.append(8 + size)
    digest = hashlib.sha256(json.dumps(decided, sort_keys=True).encode())
    with ShardReader(path) as reader:
        for key in sorted(reader.keys()):
            if not key.split("/", 1)[1].startswith("hidden_states"):
                digest.update(reader.get_tensor(key).numpy().tobytes())
    return digest.hexdigest()[:16]


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
    dataset = extracted[0] / f"{dtype}-{codec}"
    digests = [decided_by_us(dataset / s["file"]) for s in read_manifest(dataset)["shards"]]
    assert digests == GOLDEN[(dtype, codec)], (
        f"{dtype}/{codec}: the shard layout changed; if that is meant, raise CAPTURE_FORMAT_VERSION and pin the new "
        f"digests: {digests}")


def test_samples_spilled_past_a_tiny_host_buffer_give_the_same_shards(extracted, llama_model):
    """A 4-block host buffer (the least) holds samples of up to 2 steps (128 tokens): the 3 longer ones go through
    spill files, uncompressed (with Blosc2 too: compressed as they are read back) or as fp8-e4m3 encoded them
    (beside their shards, or in extract.spill_dir), and every shard's bytes are those of the run that held them all
    in memory."""
    tmp, prompts = extracted
    engines, spilled_bytes = EngineHolder(), {}
    spill_dirs = {"none": None, "blosc2-zstd": None, "fp8-e4m3": tmp / "spill-fp8"}
    try:
        for codec in spill_dirs:
            params = extraction_params(llama_model, prompts, tmp / f"spilled-{codec}", dtype="float32", codec=codec,
                                       **{**SETTINGS, "host_buffer_gb": 0.0001,
                                          "spill_dir": spill_dirs[codec] and str(spill_dirs[codec])})
            before = engines.engine.capture_stats().spilled_bytes if engines.engine is not None else 0
            run_extraction(Extraction(params), progress=False, engines=engines)
            spilled_bytes[codec] = engines.engine.capture_stats().spilled_bytes - before
    finally:
        engines.close()
    rows = 190 + 129 + 150
    # rows x captured layers x hidden x float32; fp8's codes a byte each (its scales stay in memory until written)
    assert spilled_bytes == {"none": rows * 4 * 256 * 4, "blosc2-zstd": rows * 4 * 256 * 4, "fp8-e4m3": rows * 4 * 256}
    for codec in spilled_bytes:
        assert [s["blake3"] for s in read_manifest(tmp / f"spilled-{codec}")["shards"]] == \
            [s["blake3"] for s in read_manifest(tmp / f"float32-{codec}")["shards"]]
        assert not [p.name for p in (tmp / f"spilled-{codec}" / "shards").iterdir() if p.name.startswith(".")]
    assert list(spill_dirs["fp8-e4m3"].iterdir()) == []  # made before the model loaded; its files had no name


@pytest.mark.parametrize("dtype, codec", RELEASED_BEFORE_THE_FORMAT)
def test_a_dataset_of_the_release_before_the_declared_format_is_reused_whole(extracted, llama_model, tmp_path,
                                                                             dtype, codec):
    """Its receipts carry the old key (a hash of the capture's source text) and the shard files' sha256 (BLAKE3
    since): written back as that release wrote them, they are honoured, and the extraction loads no model. Not
    with a codec since format 2 (its shards' header moved): those shards are computed again."""
    tmp, prompts = extracted
    out = shutil.copytree(tmp / f"{dtype}-{codec}", tmp_path / "ds")
    shards = [sha256_file(out / s["file"]) for s in read_manifest(out)["shards"]]
    extraction = Extraction(params_for(llama_model, prompts, out, dtype, codec))
    old_key = extraction._config_hash(code=CAPTURE_CODE_HASHES_OF_FORMAT_1[-1])  # the seed's capture code hash
    if (dtype, codec) == ("float32", "none") and extraction.model["weights_fingerprint"] == LEGACY_KEY[0]:
        assert old_key == LEGACY_KEY[1], "the formula gives the key that release wrote"
    for receipt in (out / "receipts").glob("*.json"):
        record = json.loads(receipt.read_text())
        record["config_hash"] = old_key
        del record["engine"]  # that release did not record the engine
        del record["blake3"]
        record["sha256"] = sha256_file(shard_path(out, record["shard"]))
        receipt.write_text(json.dumps(record))
    (out / "manifest.json").unlink()
    engines = CountingEngines()
    run_extraction(Extraction(params_for(llama_model, prompts, out, dtype, codec)), progress=False,
                   engines=EngineHolder(engines))
    if codec == "none":
        assert engines.created == 0
        assert [s.get("sha256") for s in read_manifest(out)["shards"]] == shards  # as recorded, not rehashed
    else:
        assert engines.created == 1 and all("blake3" in s for s in read_manifest(out)["shards"])
    result = validate_dataset(out)
    assert result.valid, result.failures


@pytest.mark.parametrize("codec", ["none", "blosc2-zstd"])
def test_format_1_shards_are_kept_without_a_codec_and_computed_again_with_one(extracted, llama_model, tmp_path, codec):
    """Format 2 moved a compressed shard's header (UNCOMPRESSED_SAME_SINCE): receipts keyed by format 1 still
    hold for uncompressed shards, whose bytes it did not change, and not for compressed ones."""
    tmp, prompts = extracted
    out = shutil.copytree(tmp / f"float32-{codec}", tmp_path / "ds")
    format_1 = Extraction(params_for(llama_model, prompts, out, "float32", codec))._config_hash(capture_format=1)
    for receipt in (out / "receipts").glob("*.json"):
        receipt.write_text(json.dumps({**json.loads(receipt.read_text()), "config_hash": format_1}))
    (out / "manifest.json").unlink()
    engines = CountingEngines()
    run_extraction(Extraction(params_for(llama_model, prompts, out, "float32", codec)), progress=False,
                   engines=EngineHolder(engines))
    assert engines.created == (0 if codec == "none" else 1)
    assert validate_dataset(out).valid
