"""The codec inside the shard file, without an engine: bit-exact round trips for every state dtype, the logical
layout visible from the header alone, the same bytes whatever the thread count, damaged blocks caught, and the
size estimate that uses the ratio measured on the first shard."""

import errno
import logging
import random

import blake3
import pytest
import torch
from safetensors import safe_open

from eagle_states.capture.engine import ShardResult
from eagle_states.dataset.codec import Codec, CorruptTensorError
from eagle_states.dataset.shard_file import ShardReader, read_header, write_shard_file
from eagle_states.extraction.driver import Extraction
from eagle_states.extraction.room import NoRoomError, check_free_space
from helpers import extraction_params, model_too_big_for_the_disk, refuse_a_write, write_prompt_jsonl

ZSTD, LZ4 = Codec("blosc2-zstd"), Codec("blosc2-lz4")


def sample_tensors(dtype):
    torch.manual_seed(0)
    pieces = [torch.randn(37, 96).to(dtype), torch.randn(1, 96).to(dtype), torch.randn(90, 96).to(dtype)]
    return {"s/input_ids": torch.arange(128, dtype=torch.int32), "s/loss_mask": torch.ones(128, dtype=torch.uint8),
            "s/hidden_states/0": pieces, "s/hidden_states/1": torch.randn(128, 96).to(dtype)}


@pytest.mark.parametrize("codec", [ZSTD, LZ4, Codec("blosc2-zstd", level=5, threads=2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_what_is_read_back_is_bit_for_bit_what_was_written(tmp_path, codec, dtype):
    tensors = sample_tensors(dtype)
    path = tmp_path / "shard.safetensors"
    digest, size = write_shard_file(path, tensors, codec)
    assert blake3.blake3(path.read_bytes()).hexdigest() == digest and path.stat().st_size == size
    # the header was written last, into the room reserved for it (whole 4 KiB blocks), padded with spaces
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = path.read_bytes()[8:8 + header_length]
    assert (8 + header_length) % 4096 == 0 and header.endswith(b" ") and header.rstrip(b" ").endswith(b"}")
    with ShardReader(path) as shard:
        assert shard.codec["name"] == codec.name and shard.codec["level"] == codec.level
        for key, value in tensors.items():
            value = torch.cat(value) if isinstance(value, list) else value
            info = shard.info(key)
            assert (info["shape"], info["compressed"]) == (list(value.shape), value.dtype.is_floating_point)
            got = shard.get_tensor(key)
            assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8))
    # still a safetensors file: safetensors itself opens it, the states as bytes, the token ids as they are
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("s/hidden_states/1").dtype == torch.uint8
        assert torch.equal(f.get_tensor("s/input_ids"), tensors["s/input_ids"])


def test_random_states_compress_and_a_plain_shard_has_no_codec_metadata(tmp_path):
    tensors = sample_tensors(torch.bfloat16)
    plain, packed = tmp_path / "plain.safetensors", tmp_path / "packed.safetensors"
    write_shard_file(plain, tensors)
    write_shard_file(packed, tensors, ZSTD)
    assert packed.stat().st_size < 0.85 * plain.stat().st_size  # bf16's sign and exponent byte compresses
    with safe_open(plain, framework="pt") as f:
        assert f.metadata() == {"format": "eagle-states/1"}
    assert ShardReader(plain).codec == {"name": "none"}


def test_pieces_compressed_as_they_come_make_the_frame_of_the_whole_tensor(monkeypatch):
    """Blosc2 compresses a state a chunk at a time as its pieces come (a spilled one streamed from its file): a
    chunk within a piece where it lies, one across pieces copied first. The frame is Blosc2's of the whole tensor
    at once, and decodes to it."""
    import blosc2

    from eagle_states.dataset import codec as codec_module

    monkeypatch.setattr(codec_module, "CHUNK_BYTES", 1536)  # 8 rows of 96 bf16 values
    torch.manual_seed(0)
    whole = torch.randn(100, 96).to(torch.bfloat16)
    # pieces ending inside a chunk, a piece of several chunks, one within a chunk, one ending on a chunk's boundary
    cuts = [0, 3, 30, 31, 40, 100]
    pieces = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    for codec in (ZSTD, LZ4):
        frame = codec.encode(iter(pieces), 2)
        cparams = {"codec": blosc2.Codec.ZSTD if codec is ZSTD else blosc2.Codec.LZ4, "clevel": 1,
                   "filters": [blosc2.Filter.SHUFFLE], "typesize": 2, "nthreads": 1}
        flat = whole.view(torch.uint8).reshape(-1).numpy()
        assert frame == blosc2.SChunk(chunksize=1536, data=flat, cparams=cparams).to_cframe()
        decoded = blosc2.schunk_from_cframe(frame)
        assert decoded.nchunks == 13 and decoded[:] == flat.tobytes()
        assert codec.encode([whole], 2) == frame


def test_the_same_tensors_give_the_same_bytes_whatever_the_thread_count(tmp_path):
    """A sample's states encoded on several threads at once give the bytes of one at a time. Blosc2's own threads
    (`codec_threads`) do too while a chunk is one of its blocks, as here; past that its bytes vary from run to run
    (README), while the states they decode to do not."""
    tensors = sample_tensors(torch.bfloat16)
    one = write_shard_file(tmp_path / "a.safetensors", tensors, Codec("blosc2-zstd", threads=1))
    four = write_shard_file(tmp_path / "b.safetensors", tensors, Codec("blosc2-zstd", threads=4))
    # the states encoded on three threads at once, as the capture's writer encodes a sample's
    at_once = write_shard_file(tmp_path / "c.safetensors", tensors, Codec("blosc2-zstd"), encode_threads=3)
    assert one == four == at_once
    large = torch.randn(4096, 2048).to(torch.bfloat16)  # 16 MiB: two chunks of many blocks each
    write_shard_file(tmp_path / "d.safetensors", {"s/hidden_states/0": large}, Codec("blosc2-zstd", threads=4))
    with ShardReader(tmp_path / "d.safetensors", threads=4) as shard:
        assert torch.equal(shard.get_tensor("s/hidden_states/0").view(torch.uint8), large.view(torch.uint8))


def test_every_flipped_byte_in_a_compressed_tensor_is_caught_when_read(tmp_path):
    path = tmp_path / "shard.safetensors"
    write_shard_file(path, sample_tensors(torch.bfloat16), ZSTD)
    data, header = path.read_bytes(), read_header(path)
    start = 8 + int.from_bytes(data[:8], "little")
    begin, end = header["s/hidden_states/0"]["data_offsets"]
    rng = random.Random(1)
    for position in rng.sample(range(begin, end), 40):
        damaged = bytearray(data)
        damaged[start + position] ^= 1 << rng.randrange(8)
        path.write_bytes(damaged)
        with pytest.raises(CorruptTensorError, match="s/hidden_states/0: stored bytes fail their CRC-32 check"):
            ShardReader(path).get_tensor("s/hidden_states/0")
        assert torch.equal(ShardReader(path).get_tensor("s/input_ids"), torch.arange(128, dtype=torch.int32))


def test_with_a_codec_the_size_check_waits_for_the_first_shard_then_uses_its_ratio(tmp_path, llama_model, caplog):
    huge = model_too_big_for_the_disk(llama_model, tmp_path)
    rows = write_prompt_jsonl(tmp_path / "rows.jsonl", [[5] * 200] * 8)
    params = extraction_params(huge, rows, tmp_path / "ds", dtype="float32", shard_max_tokens=400,
                               max_num_batched_tokens=200, codec="blosc2-zstd")
    extraction = Extraction(params)
    with caplog.at_level(logging.WARNING):
        check_free_space(extraction)  # uncompressed it does not fit; the codec may make it: a warning, no refusal
    assert "uncompressed; checked again with blosc2-zstd's ratio after the first shard" in caplog.text
    first = extraction.shards[0]
    raw = 400 * 4 * 2 ** 26 * 4
    path = extraction.job(first).path
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(raw // 4)  # as if written, a quarter of its uncompressed size (sparse: no disk used)
    result = ShardResult(first.name, "0" * 64, raw // 4, {s.sample_id: 200 for s in first.samples}, path)
    with pytest.raises(NoRoomError) as refused:
        extraction.record(first, result)  # the shard is kept (its receipt is written), the run stops
    assert refused.value.errno == errno.ENOSPC
    assert ("1,200 tokens x 4 layers x hidden 67108864 x float32 x 0.250, the ratio of blosc2-zstd measured on 1 "
            "finished shard") in str(refused.value)


@pytest.mark.parametrize("codec", [ZSTD, Codec("fp8-e4m3")], ids=str)
def test_a_compressed_shards_header_room_holds_its_widest_form_and_refuses_a_wider_one(tmp_path, codec):
    """The room is reserved before any size is known: a header whose every number is at its widest (sizes near a
    petabyte, the largest CRC-32, floats of 24 characters) fits; an entry with a field the codec never declared
    does not, and is refused naming the shard rather than written over the tensors."""
    from eagle_states.dataset.shard_file import WIDEST_CRC, WIDEST_FLOAT, WIDEST_SIZE, ShardFileWriter

    specs = {"s/hidden_states/0": (torch.bfloat16, [128, 96]), "s/hidden_states/1": (torch.bfloat16, [128, 96]),
             "s/input_ids": (torch.int32, [128]), "s/loss_mask": (torch.uint8, [128])}
    out = ShardFileWriter(tmp_path / "shard.safetensors", specs, codec)
    widest = {"dtype": "BF16", "shape": [128, 96], "crc32": WIDEST_CRC,
              **{key: WIDEST_FLOAT for key in codec.entry_extras}}
    encoded = {name: (WIDEST_SIZE, widest) for name in specs if "hidden" in name}
    assert len(out.header.make(encoded, out.header.room)[0]) == out.header.room
    encoded["s/hidden_states/1"] = (WIDEST_SIZE, {**widest, "undeclared": "x" * out.header.room})
    with pytest.raises(ValueError, match="shard.safetensors: a header of .* past its room"):
        out.header.make(encoded, out.header.room)


def test_a_compressed_shard_whose_write_fails_midway_raises_it_and_leaves_nothing(tmp_path, monkeypatch):
    """With a codec the writer encodes the next tensor while the one before is still being written: a write that
    fails behind it (here the disk refusing the third piece) still stops the shard with that error, and no file,
    temp or final, is left (tests/unit/test_step_codecs.py: the same with a step codec)."""
    refuse_a_write(monkeypatch, 3)
    tensors = {f"s{i}/hidden_states/0": torch.randn(128, 96).to(torch.bfloat16) for i in range(6)}
    with pytest.raises(OSError) as refused:
        write_shard_file(tmp_path / "shard.safetensors", tensors, ZSTD)
    assert refused.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
