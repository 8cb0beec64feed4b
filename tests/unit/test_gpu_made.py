"""Datasets made on an H200 with nvCOMP's codecs (`bench/gpu_fixtures.py`: the demo Llama in bf16, one engine, codecs
none, nvcomp-ans and fp8-e4m3-ans; in tests/fixtures/gpu-made/), read here, where there is no CUDA device to
decode them: what can be checked without decoding is checked against the plain twin, the rest is refused."""

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle_states.dataset.codec import read_header_metadata
from eagle_states.dataset.files import file_digest, recorded_digest
from eagle_states.dataset.layout import shard_path, validation_record_path
from eagle_states.dataset.manifest import read_manifest
from eagle_states.dataset.step_codecs import fp8_quantize, nvcomp_buffers

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpu-made"
NVCOMP = ["nvcomp-ans", "fp8-e4m3-ans"]


def shard_contents(codec: str) -> dict[str, tuple[dict | None, torch.Tensor]]:
    """Every tensor of the dataset as stored: key -> (its encoded entry or None, its bytes)."""
    out = {}
    for shard in read_manifest(FIXTURES / codec)["shards"]:
        with safe_open(shard_path(FIXTURES / codec, shard["name"]), framework="pt") as f:
            _, encoded = read_header_metadata(f.metadata())
            for key in f.keys():
                out[key] = encoded.get(key), f.get_tensor(key)
    return out


@pytest.mark.parametrize("codec", ["none", *NVCOMP])
def test_every_shard_is_whole_as_the_gpu_machine_recorded_it(codec):
    """Files as the manifest's digests say, compressed tensors as their CRC-32 says, the codec recorded."""
    manifest = read_manifest(FIXTURES / codec)
    assert manifest["codec"]["name"] == codec and manifest["engine"]["extract.dtype"] == "bfloat16"
    if codec != "none":
        assert manifest["codec"]["decodes_on"] == "cuda" and manifest["codec"]["nvcomp"]
    for shard in manifest["shards"]:
        algorithm, digest = recorded_digest(shard)
        assert file_digest(shard_path(FIXTURES / codec, shard["name"]), algorithm) == digest
    for key, (entry, stored) in shard_contents(codec).items():
        if entry is not None:
            assert zlib.crc32(stored.numpy()) == entry["crc32"], key


@pytest.mark.parametrize("codec", NVCOMP)
def test_the_stored_frames_hold_the_plain_twins_tensors(codec):
    """Token ids and loss masks as stored plainly; each hidden state's nvCOMP frame parses, decodes to the plain
    twin's size (bf16: 2 bytes a value; fp8 codes: 1) and holds fewer bytes than it; fp8-e4m3-ans's per-token scales
    (before its frame) are the plain states' largest magnitudes / 448, as computed on the CPU."""
    plain, ours = shard_contents("none"), shard_contents(codec)
    assert ours.keys() == plain.keys()
    stored_bytes = plain_bytes = 0
    for key, (entry, stored) in ours.items():
        states = plain[key][1]
        if entry is None:
            assert torch.equal(stored, states), key
            continue
        assert entry["shape"] == list(states.shape) and entry["dtype"] == "BF16", key
        rows, width = states.shape
        frame = stored.numpy()
        if codec == "fp8-e4m3-ans":
            scales = frame[:rows * 4].view(np.float32)
            expected = fp8_quantize(states)[1][:, 0]  # the CPU's scales; the GPU's may differ in the last bit
            assert np.allclose(scales, expected.numpy(), rtol=1e-6, atol=0), key
            frame = frame[rows * 4:]
        _, decoded = nvcomp_buffers(frame)
        assert sum(decoded) == rows * width * (1 if codec == "fp8-e4m3-ans" else 2), key
        stored_bytes, plain_bytes = stored_bytes + stored.numel(), plain_bytes + states.numel() * 2
    assert stored_bytes < plain_bytes / (1.9 if codec == "fp8-e4m3-ans" else 1.1)


def test_fp8_ans_records_its_error_per_tensor_and_layer():
    """The rounding error the device measured on the true states, in each entry and in the validation record:
    e4m3's 3 mantissa bits give a few per cent."""
    entries = [entry for entry, _ in shard_contents("fp8-e4m3-ans").values() if entry is not None]
    assert entries and all(0 < e["sq_err"] < 0.05 ** 2 * e["sq_sum"] for e in entries)
    record = json.loads(validation_record_path(FIXTURES / "fp8-e4m3-ans").read_text())  # made on the device
    assert record["summary"]["valid"]
    per_layer = record["summary"]["relative_error_per_layer"]
    assert per_layer and all(0.005 < float(v) < 0.05 for v in per_layer.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA device")
@pytest.mark.parametrize("codec", NVCOMP)
def test_an_nvcomp_dataset_on_a_machine_without_a_gpu_is_refused_at_once_in_one_line(tmp_path, capsys, codec):
    """`Dataset`, `validate` and `export` refuse it from its manifest, before any shard is read, and the CLI says so
    in one line (exit 2); the trainers read the exports made on the GPU machine."""
    from eagle_states.cli import main
    from eagle_states.dataset.reader import Dataset
    from eagle_states.dataset.step_codecs import CodecUnavailable

    copied = shutil.copytree(FIXTURES / codec, tmp_path / codec)
    shutil.copy(validation_record_path(FIXTURES / codec), validation_record_path(copied))  # validated where made
    for shard in read_manifest(copied)["shards"]:  # nothing of a shard is read before the refusal
        shard_path(copied, shard["name"]).write_bytes(b"")
    with pytest.raises(CodecUnavailable, match="decodes on a CUDA device only"):
        Dataset(copied)
    for argv in (["validate", str(copied)],
                 ["export", str(copied), "--format", "speculators", "--out", str(tmp_path / "export")]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{codec}, which decodes on a CUDA device only" in err, err
    assert not (tmp_path / "export").exists()
