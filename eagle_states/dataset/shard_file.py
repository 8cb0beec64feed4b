"""The shard file: safetensors, written as a stream (safetensors itself cannot: it wants every tensor in memory)
and its header read back without loading a tensor. One dtype table serves the writer, the validator and the
manifest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle_states.dataset.files import atomic_file
from eagle_states.dataset.layout import FORMAT_NAME, FORMAT_VERSION, key_hidden_state, key_input_ids, key_loss_mask

# torch dtype -> (safetensors code, the manifest's name)
DTYPES = {torch.float32: ("F32", "float32"), torch.bfloat16: ("BF16", "bfloat16"), torch.float16: ("F16", "float16"),
          torch.int32: ("I32", "int32"), torch.int64: ("I64", "int64"), torch.uint8: ("U8", "uint8")}
CODE_OF_NAME = {name: code for code, name in DTYPES.values()}  # "bfloat16" -> "BF16"
DTYPE_OF_NAME = {name: dtype for dtype, (_, name) in DTYPES.items()}  # "bfloat16" -> torch.bfloat16


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


class ShardFileWriter:
    """Writes one shard in the safetensors format, tensor by tensor in the file's (sorted) key order, while later
    tensors may not exist yet: the header is made from the tensors' dtypes and shapes alone, so a shard can be
    written as its samples are captured. Each tensor's pieces are streamed from memory (concatenated along dim 0
    in the file, never in memory) and hashed while a helper thread writes them past the page cache (`DirectFile`,
    where the filesystem allows; hashing and writing both release the GIL, so a shard takes as long as the slower
    of the two). Atomic: temp file, fsync, rename; an exception
    or an incomplete shard leaves nothing under `path`. After the `with` block: `sha256` and `size`.
    """

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, list[int]]]):
        self.path, self.order = Path(path), sorted(specs)
        header, offset = {"__metadata__": {"format": f"{FORMAT_NAME}/{FORMAT_VERSION}"}}, 0
        self.nbytes = {}
        for name in self.order:
            dtype, shape = specs[name]
            self.nbytes[name] = size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data to 8 bytes
        self.header = len(header_bytes).to_bytes(8, "little") + header_bytes
        self.size = len(self.header) + offset
        self.sha256: str | None = None
        self.dtypes = {name: specs[name][0] for name in self.order}

    def __enter__(self) -> "ShardFileWriter":
        self._stack = contextlib.ExitStack()
        self._file = self._stack.enter_context(atomic_file(self.path, direct=True))
        self._io = self._stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-io"))
        self._writes, self._digest, self._next = [], hashlib.sha256(), 0
        self._put(self.header)
        return self

    def _put(self, data) -> None:
        self._writes.append(self._io.submit(self._file.write, data))  # in order: one thread
        self._digest.update(data)

    def write(self, name: str, pieces: list[torch.Tensor]) -> None:
        """The next tensor in key order, as pieces to concatenate along dim 0; returns once they are written."""
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise ValueError(f"{self.path.name}: tensor {name} written where {expected} comes next")
        data = [p.contiguous().view(torch.uint8).numpy() for p in pieces]
        if any(p.dtype != self.dtypes[name] for p in pieces) or sum(d.nbytes for d in data) != self.nbytes[name]:
            raise ValueError(f"{self.path.name}: {name} got {sum(d.nbytes for d in data)} bytes of "
                             f"{sorted({str(p.dtype) for p in pieces})}, the header says {self.nbytes[name]} bytes "
                             f"of {self.dtypes[name]}")
        for chunk in data:
            self._put(chunk)
        while self._writes:  # once `write` returns the caller may reuse the pieces' memory
            self._writes.pop(0).result()
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        failure = None
        if exc_type is None:
            try:
                if self._next != len(self.order):
                    raise ValueError(f"{self.path.name}: {len(self.order) - self._next} tensors were not written "
                                     f"(next: {self.order[self._next]})")
                for write in self._writes:
                    write.result()
                self.sha256 = self._digest.hexdigest()
            except BaseException as error:
                failure = error
                exc_type, exc, tb = type(error), error, error.__traceback__
        if exc_type is not None:
            for write in self._writes:
                write.cancel()
        # the helper thread ends first, then the temp file is committed (fsync, rename) or removed
        self._stack.__exit__(exc_type, exc, tb)
        if failure is not None:
            raise failure
        return False


def write_shard_file(path: Path, tensors: dict[str, torch.Tensor | list[torch.Tensor]]) -> tuple[str, int]:
    """A whole shard from tensors in memory (a value may be a list of pieces, stored as their concatenation along
    dim 0). Keys in sorted order with one metadata entry, so the same tensors give the same bytes.
    Returns (sha256, size in bytes)."""
    pieces = {name: t if isinstance(t, list) else [t] for name, t in tensors.items()}
    specs = {name: (p[0].dtype, [sum(x.shape[0] for x in p), *p[0].shape[1:]] if p[0].dim() else [])
             for name, p in pieces.items()}
    with ShardFileWriter(path, specs) as out:
        for name in out.order:
            out.write(name, pieces[name])
    return out.sha256, out.size



def read_header(path: Path) -> dict:
    """The header of a shard (any safetensors file), checked against the file's size (a truncated file fails
    here): key -> {dtype, shape, data_offsets}, without the metadata entry."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
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
