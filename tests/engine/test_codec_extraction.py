"""Compressed extractions on the real engine: the same states as an uncompressed one, bit for bit, through the one
reader; validation from the files (a damaged compressed block named by sample and layer); exports byte-identical;
the codec part of what a shard's cache key holds. One engine per dtype serves every extraction here (the codec is
the writer's, per shard)."""

import json
import shutil

import pytest
import torch

from eagle_states.capture.engine import EngineHolder
from eagle_states.dataset.codec import CorruptTensorError
from eagle_states.dataset.files import file_digest
from eagle_states.dataset.layout import shard_path
from eagle_states.dataset.manifest import read_manifest
from eagle_states.dataset.reader import Dataset
from eagle_states.dataset.shard_file import read_header
from eagle_states.export import EXPORT_FILE, FORMATS, export_dataset
from eagle_states.extraction.driver import DatasetExists, Extraction
from eagle_states.validate import validate_dataset
from helpers import extraction_params, random_prompts, write_prompt_jsonl

CODECS = ("none", "blosc2-zstd", "blosc2-lz4")


@pytest.fixture(scope="module")
def run(tmp_path_factory, llama_model):
    """`run(codec, dtype, out=...)` extracts the module's prompts (mixed lengths, chunked prefill: steps of 48
    tokens) on an engine of that dtype kept for the next call (the bf16 test comes last); returns (dataset dir,
    cached shard count)."""
    tmp = tmp_path_factory.mktemp("codec")
    source = write_prompt_jsonl(tmp / "prompts.jsonl", random_prompts([5, 17, 140, 3, 64, 9, 33, 12], 300, seed=21))
    engines = {}  # dtype -> EngineHolder; one loaded at a time (two do not fit in the CPU build's host memory)

    def extract(codec, dtype="float32", out=None, overwrite=False, **settings):
        out = out or tmp / f"{codec}-{dtype}"
        params = extraction_params(llama_model, source, out, dtype=dtype, shard_max_tokens=96, max_model_len=256,
                                   max_num_batched_tokens=48, max_num_seqs=16, gpu_memory_utilization=0.2,
                                   codec=codec, **settings).override({"output.overwrite": overwrite})
        if dtype not in engines:
            for holder in engines.values():
                holder.close()
            engines.clear()
            engines[dtype] = EngineHolder()
        cached = []
        Extraction(params).run(engines[dtype], lambda shard, was_cached: cached.append(was_cached))
        return out, sum(cached)

    yield extract
    for holder in engines.values():
        holder.close()


def same_samples(a: Dataset, b: Dataset) -> int:
    assert a.sample_ids == b.sample_ids and a.layers == b.layers
    compared = 0
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for s, t in zip(x.hidden_states, y.hidden_states, strict=True):
            assert s.dtype == t.dtype and s.shape == t.shape
            assert torch.equal(s.view(torch.uint8), t.view(torch.uint8)), f"{x.sample_id}: bits differ"
            compared += 1
    return compared


def compressed_and_plain_read_back_bit_identical(run, dtype):
    plain, _ = run("none", dtype)
    for codec in CODECS[1:]:
        packed, _ = run(codec, dtype)
        manifest = read_manifest(packed)
        assert manifest["codec"]["name"] == codec and manifest["engine"]["extract.codec"] == codec
        assert same_samples(Dataset(plain), Dataset(packed)) == 8 * 4
        assert sum(s["bytes"] for s in manifest["shards"]) < sum(s["bytes"] for s in read_manifest(plain)["shards"])
        result = validate_dataset(packed)
        assert result.valid, result.failures
        assert result.summary["codec"] == codec
    assert read_manifest(plain)["codec"] == {"name": "none"}


def test_compressed_and_plain_extractions_read_back_bit_identical(run):
    compressed_and_plain_read_back_bit_identical(run, "float32")


def test_a_flipped_byte_in_a_compressed_block_is_named_by_validation_and_refused_by_the_reader(run, tmp_path):
    packed = shutil.copytree(run("blosc2-zstd")[0], tmp_path / "dataset")
    shard = shard_path(packed, "shard-00000")
    data = bytearray(shard.read_bytes())
    begin, end = read_header(shard)["p000/hidden_states/2"]["data_offsets"]
    data[8 + int.from_bytes(data[:8], "little") + (begin + end) // 2] ^= 0x10
    shard.write_bytes(data)
    manifest = json.loads((packed / "manifest.json").read_text())
    manifest["shards"][0]["blake3"] = file_digest(shard)  # even with the manifest's hash in step
    (packed / "manifest.json").write_text(json.dumps(manifest))
    result = validate_dataset(packed)
    assert not result.valid
    rows = {(r.sample_id, r.slot, r.layer_id, r.check) for r in result.failures.itertuples()}
    assert rows == {("p000", 2, 5, "decodes: equal_to(True)")}
    with pytest.raises(CorruptTensorError, match="p000/hidden_states/2: stored bytes fail their CRC-32 check"):
        Dataset(packed)["p000"]


def test_a_dataset_from_before_codecs_still_reads_and_validates(run, tmp_path):
    old = shutil.copytree(run("none")[0], tmp_path / "dataset")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["codec"]  # as written before codecs existed (its shards were already plain)
    for key in ("extract.codec", "extract.codec_level"):
        del manifest["engine"][key]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert validate_dataset(old).valid
    assert same_samples(Dataset(old), Dataset(run("none")[0])) == 8 * 4
    _, cached = run("none", out=old)  # the same settings today: not refused as another dataset's, all cached
    assert cached == len(manifest["shards"])


def test_exports_of_a_compressed_dataset_equal_those_of_a_plain_one_byte_for_byte(run, tmp_path):
    plain, packed = run("none")[0], run("blosc2-zstd")[0]
    for dataset in (plain, packed):
        assert validate_dataset(dataset).valid
    for fmt in FORMATS:
        export_dataset(plain, tmp_path / "plain" / fmt, fmt, progress=False)
        export_dataset(packed, tmp_path / "packed" / fmt, fmt, progress=False)
        files = sorted(p.relative_to(tmp_path / "plain" / fmt) for p in (tmp_path / "plain" / fmt).rglob("*")
                       if p.is_file() and p.name != EXPORT_FILE)  # it names its source dataset
        assert files and files == sorted(p.relative_to(tmp_path / "packed" / fmt)
                                         for p in (tmp_path / "packed" / fmt).rglob("*")
                                         if p.is_file() and p.name != EXPORT_FILE)
        for name in files:
            assert (tmp_path / "plain" / fmt / name).read_bytes() == (tmp_path / "packed" / fmt / name).read_bytes()


def test_the_codec_is_part_of_a_shards_cache_key(run, tmp_path):
    out, cached = run("blosc2-zstd", out=tmp_path / "dataset")
    first = {s["name"]: s["blake3"] for s in read_manifest(out)["shards"]}
    assert cached == 0
    _, cached = run("blosc2-zstd", out=out, codec_threads=3)  # threads do not change the bytes
    assert cached == len(first)
    assert {s["name"]: s["blake3"] for s in read_manifest(out)["shards"]} == first
    with pytest.raises(DatasetExists, match="extract.codec"):
        run("blosc2-lz4", out=out)  # another codec would replace the dataset: only when asked
    _, cached = run("blosc2-lz4", out=out, overwrite=True)
    assert cached == 0, "every shard is computed again with the other codec"
    again = {s["name"]: s["blake3"] for s in read_manifest(out)["shards"]}
    assert again.keys() == first.keys() and not set(again.values()) & set(first.values())
    assert read_manifest(out)["codec"]["name"] == "blosc2-lz4" and validate_dataset(out).valid


def test_fp8_reads_back_within_its_bound_of_the_plain_states_and_validation_measures_it_per_layer(run, tmp_path):
    """fp8-e4m3 on the real capture path (encoded per engine step, before the hand-off; chunked prefill splits
    samples across steps): the states read back within e4m3's rounding of the plain extraction's, the error the
    capture recorded is the error they have, validation reports it per layer, and the exports read it back."""
    plain, _ = run("none")
    fp8, _ = run("fp8-e4m3")
    manifest = read_manifest(fp8)
    assert manifest["codec"]["name"] == "fp8-e4m3" and manifest["codec"]["lossy"] is True
    stored = sum(s["bytes"] for s in manifest["shards"])
    assert stored < 0.3 * sum(s["bytes"] for s in read_manifest(plain)["shards"])  # fp32 -> a byte and a scale
    errors, norms = {}, {}
    for x, y in zip(Dataset(fp8), Dataset(plain)):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for k, s, t in zip(manifest["layer_ids"], x.hidden_states, y.hidden_states, strict=True):
            assert s.dtype == t.dtype == torch.float32 and s.shape == t.shape
            errors[k] = errors.get(k, 0.0) + float(((s - t) ** 2).sum())
            norms[k] = norms.get(k, 0.0) + float((t ** 2).sum())
    result = validate_dataset(fp8)
    assert result.valid, result.failures
    recorded = result.summary["relative_error_per_layer"]
    assert sorted(recorded) == sorted(manifest["layer_ids"])
    for k in manifest["layer_ids"]:
        measured = (errors[k] / norms[k]) ** 0.5
        assert 0.005 < measured < 0.05 and recorded[k] == pytest.approx(measured, rel=1e-3)
    again = validate_dataset(fp8)  # the verdict recorded beside it, read back: the same figures, the same keys
    assert again.summary["reused"] and again.summary["relative_error_per_layer"] == recorded
    export_dataset(fp8, tmp_path / "speculators", "speculators", progress=False)
    assert (tmp_path / "speculators" / EXPORT_FILE).exists()


@pytest.mark.parametrize("codec", ["nvcomp-ans", "fp8-e4m3-ans"])
def test_nvcomp_where_it_cannot_run_is_refused_saying_what_it_needs(run, tmp_path, codec):
    """Without nvCOMP's package (CI) the settings are refused before any shard; with it, the CPU build's engine
    refuses the first step: nothing is written that this machine could not read back."""
    with pytest.raises(RuntimeError, match=f"{codec}( and .*)? need nvCOMP|{codec} encodes on a CUDA device"):
        run(codec, out=tmp_path / "dataset")
    assert not (tmp_path / "dataset" / "manifest.json").exists()


def test_compressed_and_plain_bf16_extractions_read_back_bit_identical(run):
    compressed_and_plain_read_back_bit_identical(run, "bfloat16")
