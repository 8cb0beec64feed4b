"""The shard file: safetensors, written as a stream (safetensors itself cannot: it wants every tensor in memory)
and its header read back without loading a tensor. One dtype table serves the writer, the validator and the
manifest."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from eagle_states.dataset.codec import (LOSSY_ENTRY_EXTRAS, Codec, CorruptTensorError, decode, encoded_entry,
                                        header_metadata, read_header_metadata)
from eagle_states.dataset.files import atomic_file, check_regular, open_regular, shard_hasher
from eagle_states.dataset.kept_bytes import ShardRoom
from eagle_states.dataset.layout import FORMAT_NAME, FORMAT_VERSION, key_hidden_state, key_input_ids, key_loss_mask

# torch dtype -> (safetensors code, the manifest's name)
DTYPES = {torch.float32: ("F32", "float32"), torch.bfloat16: ("BF16", "bfloat16"), torch.float16: ("F16", "float16"),
          torch.int32: ("I32", "int32"), torch.int64: ("I64", "int64"), torch.uint8: ("U8", "uint8")}
CODE_OF_NAME = {name: code for code, name in DTYPES.values()}  # "bfloat16" -> "BF16"
DTYPE_OF_NAME = {name: dtype for dtype, (_, name) in DTYPES.items()}  # "bfloat16" -> torch.bfloat16
DTYPE_OF_CODE = {code: dtype for dtype, (code, _) in DTYPES.items()}  # "BF16" -> torch.bfloat16


def shard_data_bytes(token_counts: list[int], num_slots: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The bytes a shard of samples with these token counts holds, its header aside (a few KiB)."""
    return sum(math.prod(shape) * dt.itemsize for n in token_counts
               for dt, shape in sample_tensor_specs("x", n, num_slots, hidden_size, dtype).values())


def sample_tensor_specs(sample_id: str, num_tokens: int, num_slots: int, hidden_size: int,
                        dtype: torch.dtype) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The tensors one sample contributes to a shard: key -> (dtype, shape)."""
    specs = {key_input_ids(sample_id): (torch.int32, [num_tokens]),
             key_loss_mask(sample_id): (torch.uint8, [num_tokens])}
    for slot in range(num_slots):
        specs[key_hidden_state(sample_id, slot)] = (dtype, [num_tokens, hidden_size])
    return specs


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor too large to hold (a spilled sample's state), given as pieces made on demand: of its dtype, or of
    its stored bytes when a step codec encoded it (then `rows` and the codec's `record` of it say what the stored
    bytes cannot). `pieces` may be called again, and gives the same pieces; a piece may be overwritten once the piece
    after next is made (two at most are in memory: the one written, the one read)."""
    pieces: Callable[[], Iterable[torch.Tensor]]
    rows: int
    record: dict = field(default_factory=dict)


# A compressed shard's header is written last, into room reserved at the file's start for its largest form: every
# stored size and offset at its widest (below a petabyte), every CRC-32 and float of the codec's entries too (a
# float as Python's repr writes one: at most 24 characters). The room ends on a 4 KiB boundary (O_DIRECT writes
# whole blocks), and the header is padded to it with spaces (safetensors allows trailing whitespace).
WIDEST_SIZE, WIDEST_CRC, WIDEST_FLOAT = 10**15 - 1, 2**32 - 1, -1.7976931348623157e308
HEADER_ALIGN = 4096


class ShardHeader:
    """What a shard's safetensors header says, known before any tensor is: its tensors in key order with their
    dtypes, shapes and sizes, the room reserved for the header at a compressed shard's start (its widest form),
    the header's bytes once the stored sizes are known (`make`), and the checks that what is written is what it
    says."""

    def __init__(self, file_name: str, specs: dict[str, tuple[torch.dtype, list[int]]], codec: Codec):
        self.file_name, self.specs, self.codec, self.order = file_name, specs, codec, sorted(specs)
        self.nbytes = {name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in specs.items()}
        self.dtypes = {name: specs[name][0] for name in self.order}
        self.room = 0
        if codec.enabled:
            extras = {key: WIDEST_FLOAT for key in codec.entry_extras}
            largest, _ = self.make({name: (WIDEST_SIZE, encoded_entry(DTYPES[dtype][0], shape, WIDEST_CRC, extras))
                                    for name, (dtype, shape) in specs.items() if codec.encodes(dtype)})
            self.room = -(-len(largest) // HEADER_ALIGN) * HEADER_ALIGN

    def make(self, encoded: dict[str, tuple[int, dict]], room: int = 0) -> tuple[bytes, int]:
        """The safetensors header, its 8-byte length first, and the file's size with it: each tensor as stored (a
        compressed one, `encoded`'s (stored size, entry), as U8 bytes, its logical dtype and shape in the
        metadata), in key order; padded with spaces to 8 bytes, or to fill `room` bytes."""
        header, entries, offset = {"__metadata__": {"format": f"{FORMAT_NAME}/{FORMAT_VERSION}"}}, {}, 0
        for name in self.order:
            dtype, shape = self.specs[name]
            if name in encoded:
                size, entries[name] = encoded[name]
                entry = {"dtype": "U8", "shape": [size]}
            else:
                entry, size = {"dtype": DTYPES[dtype][0], "shape": list(shape)}, self.nbytes[name]
            header[name] = {**entry, "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"].update(header_metadata(self.codec, entries))
        text = json.dumps(header, separators=(",", ":")).encode()
        length = room - 8 if room else len(text) + (-len(text) % 8)  # the format aligns the data to 8 bytes
        if len(text) > length:
            raise ValueError(f"{self.file_name}: a header of {len(text)} bytes past its room of {length}")
        return length.to_bytes(8, "little") + text.ljust(length), 8 + length + offset

    def check_name(self, index: int, name: str) -> None:
        """`name` is the tensor at `index` in key order."""
        expected = self.order[index] if index < len(self.order) else None
        if name != expected:
            raise ValueError(f"{self.file_name}: tensor {name} written where {expected} comes next")

    def check_streamed(self, index: int, name: str, rows: int) -> None:
        """`name` is the tensor at `index` in key order, and a tensor of `rows` rows can be streamed to it (a step
        codec's as its stored bytes; the bytes of any other are counted as they come: `counted`)."""
        self.check_name(index, name)
        if not (self.codec.on_device and self.codec.encodes(self.dtypes[name])):
            return
        if rows != self.specs[name][1][0]:
            raise ValueError(f"{self.file_name}: {name} got {rows} encoded rows, the header says "
                             f"{self.specs[name][1][0]}")

    def counted(self, name: str, pieces: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """A streamed tensor's pieces of its dtype, refused at the first past the header's size or of another dtype,
        and at their end if short."""
        dtype, nbytes, written = self.dtypes[name], self.nbytes[name], 0
        for piece in pieces:
            written += piece.numel() * piece.element_size()
            if piece.dtype != dtype or written > nbytes:
                raise ValueError(f"{self.file_name}: {name} got {written:,} bytes or more of {piece.dtype}, the "
                                 f"header says {nbytes:,} bytes of {dtype}")
            yield piece
        if written != nbytes:
            raise ValueError(f"{self.file_name}: {name} got {written:,} bytes, the header says {nbytes:,}")

    def check(self, index: int, name: str, pieces: list[torch.Tensor]) -> None:
        """`name` is the tensor at `index` in key order, and its pieces are what the header says."""
        self.check_name(index, name)
        if self.codec.on_device and self.codec.encodes(self.dtypes[name]):
            rows = sum(p.rows for p in pieces)
            if rows != self.specs[name][1][0]:
                raise ValueError(f"{self.file_name}: {name} got {rows} encoded rows, the header says "
                                 f"{self.specs[name][1][0]}")
        else:
            nbytes = sum(p.numel() * p.element_size() for p in pieces)
            if any(p.dtype != self.dtypes[name] for p in pieces) or nbytes != self.nbytes[name]:
                raise ValueError(f"{self.file_name}: {name} got {nbytes} bytes of "
                                 f"{sorted({str(p.dtype) for p in pieces})}, the header says {self.nbytes[name]} "
                                 f"bytes of {self.dtypes[name]}")


class ShardFileWriter:
    """Writes one shard in the safetensors format, tensor by tensor in the file's (sorted) key order, while later
    tensors may not exist yet, so that a shard is written as its samples are captured. Each tensor's pieces are
    streamed from memory (concatenated along dim 0 in the file, never in memory) by a helper thread, past the
    page cache (`DirectFile`, where the filesystem allows). Atomic: temp file, fsync, rename; an exception or an
    incomplete shard leaves nothing under `path`. After the `with` block: `digest` (`files.SHARD_DIGEST`), `size`.

    Uncompressed, the header is made from the tensors' dtypes and shapes alone and written first, and the file is
    hashed as it is written (hashing and writing both release the GIL, so a shard takes as long as the slower of
    the two). With a codec (`codec.Codec`), each hidden state is compressed as it arrives (a step codec's was on
    the device: framed here), up to `encode_threads` of them at once, and written behind the header's reserved
    room; the header, which needs the compressed sizes, goes into its room at the end, and the file is hashed
    then, from the compressed tensors kept in memory until the shard's end (the digest is of the file in order,
    header first), while the helper thread still writes the last of them; tensors are encoded while the ones
    before are written. Those kept tensors are counted in `kept` (`kept_bytes`), which may make `write_many` wait.
    """

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, list[int]]], codec: Codec = Codec(),
                 encode_threads: int = 1, kept: ShardRoom | None = None):
        self.path, self.codec = Path(path), codec
        self.header = ShardHeader(self.path.name, specs, codec)
        self.order = self.header.order  # the tensors' key order, in which they are written
        self.encode_threads = encode_threads
        self.kept = kept  # where the kept compressed tensors are counted (`kept_bytes`); None: unbounded
        self.size: int | None = None  # set with the header
        self.digest: str | None = None
        # with a codec: each tensor as written, for the digest at the end (a streamed one: streamed again then)
        self._kept: dict[str, list | StreamedTensor] = {}
        self._encoded: dict[str, tuple[int, dict]] = {}  # a compressed tensor's stored size and header entry
        self.encoded_bytes, self.encode_s = 0, 0.0  # what the codec took in, and its time
        # the caller's time hashing, waiting for the helper thread's writes, and committing (the header, fsync,
        # rename; the rest of a shard's time in the caller is waiting for encoders and opening)
        self.hash_s = self.write_wait_s = self.commit_s = 0.0

    def __enter__(self) -> "ShardFileWriter":
        self._stack = contextlib.ExitStack()
        self._file = self._stack.enter_context(atomic_file(self.path, direct=True))
        self._io = self._stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-io"))
        self._encoders = self._stack.enter_context(
            ThreadPoolExecutor(max_workers=self.encode_threads, thread_name_prefix="shard-encode"))
        self._writes, self._hasher, self._next = [], shard_hasher(), 0
        if self.codec.enabled:
            self._put(bytes(self.header.room))
        else:
            head, self.size = self.header.make({})
            self._put(head)
        return self

    def _put(self, data) -> None:
        self._writes.append(self._io.submit(self._file.write, data))  # in order: one thread
        if not self.codec.enabled:
            self._hash(data)

    def _hash(self, data) -> None:
        started = time.perf_counter()
        self._hasher.update(data)
        self.hash_s += time.perf_counter() - started

    def _wait_for_write(self, write) -> None:
        started = time.perf_counter()
        write.result()
        self.write_wait_s += time.perf_counter() - started

    def write(self, name: str, pieces: list[torch.Tensor]) -> None:
        """The next tensor in key order (`write_many`)."""
        self.write_many({name: pieces})

    def write_many(self, tensors: dict[str, list[torch.Tensor]]) -> None:
        """The next tensors in key order, each as pieces to concatenate along dim 0; returns once they are
        written, or with a codec once they are encoded (the pieces are free then). With a step codec, a hidden
        state's pieces are the ones it encoded on the device (`step_codecs`). With a codec, the hidden states are
        encoded on up to `encode_threads` threads at once (a sample's states: the shard's last sample reaches the
        file sooner after the run's last step)."""
        for offset, (name, pieces) in enumerate(tensors.items()):
            self.header.check(self._next + offset, name, pieces)
        encodable = [name for name in tensors if self.codec.encodes(self.header.dtypes[name])]
        if self.kept is not None and encodable:  # room for what is kept, taken at the captured size (a bound)
            self.kept.take(sum(self.header.nbytes[name] for name in encodable))
        # on the encoder threads: torch.cat (a step codec's framing), Blosc2 and zlib's CRC-32 let go of the GIL
        encoded = {name: self._encoders.submit(self._encode, name, tensors[name]) for name in encodable}
        try:
            for name, pieces in tensors.items():
                if name in encoded:
                    self._put_encoded(name, *encoded[name].result())
                else:
                    data = [p.contiguous().view(torch.uint8).numpy() for p in pieces]
                    if self.codec.enabled:  # token ids, loss masks: small
                        data = self._kept[name] = [chunk.copy() for chunk in data]
                    for chunk in data:
                        self._put(chunk)
                self._next += 1
        finally:
            wait(encoded.values())  # a failed tensor's neighbours still read their pieces
        # Uncompressed, the caller may reuse the pieces' memory once this returns: wait for them. With a codec,
        # what was queued is this writer's own copy (compressed, framed or copied, kept for the digest): the next
        # tensors are encoded while these go to the file, and a failed write surfaces at the next call.
        while self._writes and (not self.codec.enabled or self._writes[0].done()):
            self._wait_for_write(self._writes.pop(0))

    def write_streamed(self, name: str, tensor: StreamedTensor) -> None:
        """The next tensor in key order, from pieces made while it is written (a spilled sample's state read back
        from its file, `capture.spill`): each is dropped once written, so that two at most are in memory whatever
        the tensor's size. With a step codec the pieces are its stored bytes, and they are made once more for the
        digest at the shard's end rather than kept (checked against their CRC-32 then). A CPU codec compresses the
        pieces as they come, and its frame is kept as a held tensor's is."""
        self.header.check_streamed(self._next, name, tensor.rows)
        dtype, encoded = self.header.dtypes[name], self.codec.encodes(self.header.dtypes[name])
        if encoded and not self.codec.on_device:
            if self.kept is not None:
                self.kept.take(self.header.nbytes[name])
            self._put_encoded(name, *self._encode(name, self.header.counted(name, tensor.pieces())))
            self._next += 1
            return
        written, crc = 0, 0
        for piece in (tensor.pieces() if encoded else self.header.counted(name, tensor.pieces())):
            data = piece.contiguous().view(torch.uint8).numpy()
            written += data.nbytes
            if encoded:
                crc = zlib.crc32(data, crc)
            self._put(data)
            while len(self._writes) > 1:
                self._wait_for_write(self._writes.pop(0))
        if encoded:
            shape = self.header.specs[name][1]
            self._encoded[name] = written, encoded_entry(DTYPES[dtype][0], shape, crc, tensor.record)
            self._kept[name] = tensor
        self._next += 1
        while self._writes:
            self._wait_for_write(self._writes.pop(0))

    def _put_encoded(self, name: str, stored, entry: dict, spent: float) -> None:
        """A compressed tensor (`_encode`) to the file, kept for the digest; its room beyond its stored bytes given
        back."""
        if self.kept is not None:
            self.kept.give_back(self.header.nbytes[name] - len(stored))
        self._encoded[name] = len(stored), entry
        self._kept[name] = [stored]
        self._put(stored)
        if not self.codec.on_device:
            self.encode_s += spent
            self.encoded_bytes += self.header.nbytes[name]

    def _hash_kept(self, name: str) -> None:
        """A compressed shard's tensor, in the digest: as kept in memory, or streamed again."""
        kept = self._kept[name]
        if not isinstance(kept, StreamedTensor):
            for chunk in kept:
                self._hash(chunk)
            return
        crc = 0
        for piece in kept.pieces():
            data = piece.contiguous().view(torch.uint8).numpy()
            crc = zlib.crc32(data, crc)
            self._hash(data)
        if crc != self._encoded[name][1]["crc32"]:
            raise OSError(f"{self.path.name}: {name} streamed again for the digest gave other bytes than were written")

    def _encode(self, name: str, pieces: Iterable) -> tuple[bytes | np.ndarray, dict, float]:
        """A hidden state's stored bytes, its header entry (with the CRC-32) and the time its encoding took."""
        dtype, shape = self.header.specs[name]
        started = time.perf_counter()
        if self.codec.on_device:
            stored, extra = self.codec.frame(pieces)
        else:
            stored, extra = self.codec.encode(pieces, dtype.itemsize), {}
        spent = time.perf_counter() - started
        return stored, encoded_entry(DTYPES[dtype][0], shape, zlib.crc32(stored), extra), spent

    def __exit__(self, exc_type, exc, tb) -> bool:
        failure = None
        if exc_type is None:
            try:
                if self._next != len(self.order):
                    raise ValueError(f"{self.path.name}: {len(self.order) - self._next} tensors were not written "
                                     f"(next: {self.order[self._next]})")
                if self.codec.enabled:  # hashed while the last tensors are still being written
                    header, self.size = self.header.make(self._encoded, self.header.room)
                    self._hash(header)
                    for name in self.order:
                        self._hash_kept(name)
                for write in self._writes:
                    self._wait_for_write(write)
                committing = time.perf_counter()
                if self.codec.enabled:
                    self._file.write_head(header)
                self.digest = self._hasher.hexdigest()
            except BaseException as error:
                failure = error
                exc_type, exc, tb = type(error), error, error.__traceback__
        if exc_type is not None:
            for write in self._writes:
                write.cancel()
        self._kept, self._encoded = {}, {}
        # the helper thread ends first, then the temp file is committed (fsync, rename) or removed
        self._stack.__exit__(exc_type, exc, tb)
        if failure is not None:
            raise failure
        if exc_type is None:
            self.commit_s = time.perf_counter() - committing
        return False


def write_shard_file(path: Path, tensors: dict[str, torch.Tensor | list[torch.Tensor]],
                     codec: Codec = Codec(), encode_threads: int = 1) -> tuple[str, int]:
    """A whole shard from tensors in memory (a value may be a list of pieces, stored as their concatenation along
    dim 0). Keys in sorted order with one metadata entry, so the same tensors give the same bytes, whatever
    `encode_threads`. Returns (digest, size in bytes)."""
    pieces = {name: t if isinstance(t, list) else [t] for name, t in tensors.items()}
    specs = {name: (p[0].dtype, [sum(x.shape[0] for x in p), *p[0].shape[1:]] if p[0].dim() else [])
             for name, p in pieces.items()}
    with ShardFileWriter(path, specs, codec, encode_threads) as out:
        out.write_many({name: pieces[name] for name in out.order})
    return out.digest, out.size



def read_header(path: Path) -> dict:
    """The header of a shard (any safetensors file), checked against the file's size (a truncated file fails
    here): key -> {dtype, shape, data_offsets}, without the metadata entry."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"tensors end at byte {8 + n + end}, the file has {size} (truncated or padded)")
    return header


class ShardReader:
    """Reads a shard's tensors as they were captured, compressed or not: `info(key)` gives the logical dtype code
    and shape from the header alone, `get_tensor(key)` the tensor (decoded and checked where compressed).
    `codec` is the shard's codec record ({"name": "none"} for a plain shard)."""

    def __init__(self, path: Path, threads: int = 1):
        from safetensors import safe_open

        self.path, self.threads = check_regular(path), threads
        self._file = safe_open(self.path, framework="pt")
        self.codec, self._encoded = read_header_metadata(self._file.metadata())
        self._header = read_header(self.path)

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self._file = None

    def keys(self) -> list[str]:
        return list(self._header)

    def info(self, key: str) -> dict:
        """{"dtype": safetensors code, "shape": [...], "compressed": bool}: the tensor as captured; a lossy codec's
        tensor also has its "sq_err" and "sq_sum" (the rounding error and the states' norm, squared, summed)."""
        entry = self._encoded.get(key)
        if entry is not None:
            extra = {k: entry[k] for k in LOSSY_ENTRY_EXTRAS if k in entry}
            return {"dtype": entry["dtype"], "shape": entry["shape"], "compressed": True, **extra}
        return {"dtype": self._header[key]["dtype"], "shape": self._header[key]["shape"], "compressed": False}

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._encoded.get(key)
        if entry is None:
            return self._file.get_tensor(key)
        try:
            return decode(self._file.get_tensor(key).numpy(), entry, DTYPE_OF_CODE[entry["dtype"]], self.threads,
                          self.codec.get("name"))
        except CorruptTensorError as exc:
            raise CorruptTensorError(f"{self.path}: {key}: {exc}") from None
