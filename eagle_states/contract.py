"""The data contract: layer semantics, dataset layout, manifest, shard keys, atomic writes and the reader.

Everything that writes, checks or converts a dataset goes through this module, so the layout is defined once:

    DATASET/
      manifest.json                      format, layer ids + semantics, model identity, dtype, counts, shard hashes
      index.parquet                      one row per sample: sample_id, shard, num_tokens, num_loss_tokens, source_row
      shards/shard-NNNNN.safetensors     per sample: {sid}/input_ids [T], {sid}/loss_mask [T],
                                         {sid}/hidden_states/{j} [T, H] for j = 0..L-1 in manifest layer order
      receipts/shard-NNNNN.json          written after each shard is on disk (used for resume; not part of a
                                         finished dataset's identity)

The manifest is written last: a directory without `manifest.json` is an unfinished extraction.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import mmap
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

FORMAT_NAME = "eagle-states"
FORMAT_VERSION = 1

# The one statement of what a layer id means. Everything that records or interprets layer ids refers to this.
LAYER_SEMANTICS = (
    "layer id k = the residual stream entering decoder layer k (k = 0 is the token embeddings); "
    "k = num_layers is the last decoder layer's output before the final norm"
)


def eagle3_default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice: a low, a middle and a high layer, then the final state before the norm."""
    ids = [2, num_layers // 2, num_layers - 3, num_layers]
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"the EAGLE-3 default {ids} is not usable for a model of {num_layers} layers; give layer ids")
    return ids


def resolve_layer_ids(spec, num_layers: int) -> list[int]:
    """`spec` is 'eagle3', a list of ints, or a comma-separated string."""
    if spec is None or spec == "eagle3":
        return eagle3_default_layer_ids(num_layers)
    if isinstance(spec, str):
        spec = [int(part) for part in spec.split(",") if part.strip()]
    ids = [int(k) for k in spec]
    if not ids:
        raise ValueError("layer ids: empty list")
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside 0..{num_layers} ({LAYER_SEMANTICS})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids {ids} contain duplicates")
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Layout
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.parquet"
SHARDS_DIR = "shards"
RECEIPTS_DIR = "receipts"

_SAMPLE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


def check_sample_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not _SAMPLE_ID.match(sample_id):
        raise ValueError(f"sample id {sample_id!r}: use 1-200 characters of letters, digits, '.', '_', ':', '-'")
    return sample_id


def shard_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}"


def shard_path(dataset_dir: Path, name: str) -> Path:
    return Path(dataset_dir) / SHARDS_DIR / f"{name}.safetensors"


def receipt_path(dataset_dir: Path, name: str) -> Path:
    return Path(dataset_dir) / RECEIPTS_DIR / f"{name}.json"


def key_input_ids(sample_id: str) -> str:
    return f"{sample_id}/input_ids"


def key_loss_mask(sample_id: str) -> str:
    return f"{sample_id}/loss_mask"


def key_hidden_state(sample_id: str, j: int) -> str:
    return f"{sample_id}/hidden_states/{j}"


_KEY = re.compile(r"^(?P<sid>[^/]+)/(?:(?P<field>input_ids|loss_mask)|hidden_states/(?P<j>\d+))$")


@dataclass(frozen=True)
class TensorKey:
    sample_id: str
    field: str  # "input_ids", "loss_mask" or "hidden_states"
    layer_slot: int | None  # j for hidden_states


def parse_key(key: str) -> TensorKey | None:
    """None for a key that is not part of the contract."""
    m = _KEY.match(key)
    if not m:
        return None
    if m["field"]:
        return TensorKey(m["sid"], m["field"], None)
    return TensorKey(m["sid"], "hidden_states", int(m["j"]))


# ---------------------------------------------------------------------------------------------------------------
# Atomic writes and hashing
def _libc_sync_file_range():
    """Linux's sync_file_range, or None where there is none (the final fsync alone then does the writing)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


class StreamingFile:
    """An unbuffered file that hands each 64 MiB it has written to the disk at once and waits for the 64 MiB
    before it.

    Without this the kernel starts writing only past its dirty-memory threshold (10% of RAM: 13 GB on a 128 GB
    host), so the disk idles while a shard is produced and the closing fsync then waits for all of it: a shard
    writer reached a third of the disk's speed that way. Streaming keeps the disk busy while the data is produced
    and bounds dirty memory per file to 128 MiB. Durability still comes from the fsync in `atomic_file`.
    """

    WRITEBACK_BYTES = 64 << 20

    def __init__(self, raw):
        self.raw = raw
        self.written = 0
        self.handed = 0  # bytes handed to the disk
        self.previous: tuple[int, int] | None = None  # the range handed before the last one

    def write(self, data) -> None:
        """Write all of `data` (bytes, memoryview or a contiguous numpy array)."""
        data = memoryview(data).cast("B")
        while data:
            n = self.raw.write(data)
            data = data[n:]
            self.written += n
            if self.written - self.handed >= self.WRITEBACK_BYTES:
                self._hand_to_disk()

    def _hand_to_disk(self):
        if _SYNC_FILE_RANGE is not None:  # ctypes releases the GIL during the call
            fd, span = self.raw.fileno(), (self.handed, self.written - self.handed)
            _SYNC_FILE_RANGE(fd, *span, _SYNC_WRITE)
            if self.previous is not None:
                _SYNC_FILE_RANGE(fd, *self.previous, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
            self.previous = span
        self.handed = self.written


class DirectFile:
    """A file written past the page cache (O_DIRECT), for shards: data is copied into two page-aligned buffers,
    one filling while a helper thread writes the other to the disk; `finish` writes the last, partial block
    padded and truncates the file to its length.

    One stream writes faster this way (bench/disk_check.py: 1.83-2.13 against 0.92-1.72 GB/s buffered and
    streamed on the H200 machine's disk, 2.6-3.0 against 0.4 GB/s on a 2-core CI machine), and shards, written
    once and read later, do not fill the page cache. Copies into the buffers go through numpy, which releases the
    GIL for them.
    """

    ALIGN = 4096  # the largest logical block size O_DIRECT asks of offsets, lengths and addresses
    CHUNK = 32 << 20

    def __init__(self, fd: int):
        self.fd = fd
        self.buffers = [np.frombuffer(mmap.mmap(-1, self.CHUNK), np.uint8) for _ in range(2)]  # page-aligned
        self.pending = [None, None]  # the helper's write of each buffer, until it is done
        self.current, self.fill, self.written = 0, 0, 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-io")

    @classmethod
    def open(cls, path: Path) -> "DirectFile | None":
        """None where the filesystem refuses O_DIRECT."""
        try:
            return cls(os.open(path, os.O_WRONLY | os.O_DIRECT))
        except (OSError, AttributeError):  # EINVAL on filesystems without it; no os.O_DIRECT off Linux
            return None

    def write(self, data) -> None:
        """Write all of `data` (bytes, memoryview or a contiguous numpy array)."""
        src = np.frombuffer(data, np.uint8)
        while src.size:
            n = min(src.size, self.CHUNK - self.fill)
            self.buffers[self.current][self.fill:self.fill + n] = src[:n]
            self.fill, self.written, src = self.fill + n, self.written + n, src[n:]
            if self.fill == self.CHUNK:
                self._hand_over(self.CHUNK)

    def _hand_over(self, length: int) -> None:
        """Queue the current buffer's first `length` bytes for the disk and switch to the other buffer."""
        self.pending[self.current] = self._io.submit(self._write_all, self.buffers[self.current][:length])
        self.current, self.fill = 1 - self.current, 0
        if self.pending[self.current] is not None:
            self.pending[self.current].result()  # that buffer's last write is done before it is refilled
            self.pending[self.current] = None

    def _write_all(self, view) -> None:
        view = memoryview(view)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> None:
        """Write what is left (the last block padded), wait for every write, truncate the padding away."""
        if self.fill:
            self._hand_over(-(-self.fill // self.ALIGN) * self.ALIGN)
        for future in self.pending:
            if future is not None:
                future.result()  # raises the helper's write error
        os.ftruncate(self.fd, self.written)

    def close(self) -> None:
        """After `finish`, or instead of it when the file is given up: no write is left running."""
        self._io.shutdown(wait=True)
        os.close(self.fd)


@contextlib.contextmanager
def atomic_file(path: Path, durable: bool = True, direct: bool = False) -> Iterator[StreamingFile | DirectFile]:
    """A file at a temp name in the same directory, written through `StreamingFile` (or `DirectFile` with
    `direct`, where the filesystem takes O_DIRECT); on success it is fsynced and renamed to `path`, on failure
    removed: a crash never leaves a partial file under the final name. `durable=False` skips the fsync, for
    small files that a caller makes durable later with `fsync_path` (an fsync waits for the filesystem journal,
    which can wait for gigabytes of other files' writes in flight)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb", buffering=0) as raw:
            out = (DirectFile.open(tmp) if direct else None) or StreamingFile(raw)
            try:
                yield out
                if isinstance(out, DirectFile):
                    out.finish()
            finally:
                if isinstance(out, DirectFile):
                    out.close()
            if durable:
                os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes | memoryview, durable: bool = True) -> None:
    with atomic_file(path, durable) as f:
        f.write(data)


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), durable)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
              torch.int64: "I64", torch.uint8: "U8"}


def shard_sample_order(sample_ids: list[str]) -> list[str]:
    """The order in which samples appear in a shard file. Keys are stored sorted and all of a sample's keys
    share its `sample_id/` prefix, so they are contiguous and samples follow the order of `sample_id + "/"`."""
    return sorted(sample_ids, key=lambda sid: sid + "/")


def sample_tensor_specs(sample_id: str, num_tokens: int, num_layer_slots: int, hidden_size: int,
                        dtype: torch.dtype) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The tensors one sample contributes to a shard: key -> (dtype, shape)."""
    specs = {key_input_ids(sample_id): (torch.int32, [num_tokens]),
             key_loss_mask(sample_id): (torch.uint8, [num_tokens])}
    for j in range(num_layer_slots):
        specs[key_hidden_state(sample_id, j)] = (dtype, [num_tokens, hidden_size])
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
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
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


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        if p.exists():
            h.update(p.name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Model identity (recorded in the manifest, and part of cache keys)
def _weights_fingerprint(model_dir: Path) -> str:
    """Fingerprint of the weight files without reading terabytes: name, size, the safetensors header (shapes,
    dtypes, offsets) and 16 sampled 64 KiB blocks of each file."""
    h = hashlib.sha256()
    for p in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                header_len = int.from_bytes(f.read(8), "little")
                h.update(f.read(header_len))
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(64 << 10))
    return h.hexdigest()


def model_identity(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    tokenizer_files = [model_dir / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                               "special_tokens_map.json", "tokenizer.model")]
    return {
        "path": str(model_dir.resolve()),
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "num_layers": int(text_config["num_hidden_layers"]),
        "hidden_size": int(text_config["hidden_size"]),
        "vocab_size": int(text_config["vocab_size"]),
        "config_sha256": hash_json(config),
        "weights_fingerprint": _weights_fingerprint(model_dir),
        "tokenizer_sha256": hash_files(tokenizer_files),
    }


# ---------------------------------------------------------------------------------------------------------------
# Manifest
def build_manifest(*, layer_ids: list[int], model: dict, dtype: str, shards: list[dict], num_samples: int,
                   num_tokens: int, num_loss_tokens: int, input_sha256: str, versions: dict,
                   extra: dict | None = None) -> dict:
    """`shards`: [{name, file, sha256, bytes, num_samples, num_tokens}], in shard order."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layer_ids": list(layer_ids),
        "layer_semantics": LAYER_SEMANTICS,
        "num_layers_captured": len(layer_ids),
        "model": model,
        "hidden_size": model["hidden_size"],
        "dtype": dtype,
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "input_sha256": input_sha256,
        "shards": shards,
        "versions": versions,
        **(extra or {}),
    }


def read_manifest(dataset_dir: Path) -> dict:
    path = Path(dataset_dir) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{dataset_dir}: no {MANIFEST_FILE}; this is not a finished dataset")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}")
    return manifest


SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
INDEX_COLUMNS = ["sample_id", "shard", "num_tokens", "num_loss_tokens", "source_row"]


# ---------------------------------------------------------------------------------------------------------------
# Reader
@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    hidden_states: list[torch.Tensor]  # L tensors of [T, H], in manifest layer order


class Dataset:
    """Reads a finished dataset: `Dataset(dir)[sample_id]`, or iterate in shard order (one shard open at a time)."""

    def __init__(self, dataset_dir: Path):
        import pandas as pd

        self.dir = Path(dataset_dir)
        self.manifest = read_manifest(self.dir)
        self.layer_ids: list[int] = self.manifest["layer_ids"]
        self.index = pd.read_parquet(self.dir / INDEX_FILE)
        self._shard_of = dict(zip(self.index["sample_id"], self.index["shard"]))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.index["sample_id"])

    def _read(self, f, sample_id: str) -> Sample:
        return Sample(sample_id, f.get_tensor(key_input_ids(sample_id)), f.get_tensor(key_loss_mask(sample_id)),
                      [f.get_tensor(key_hidden_state(sample_id, j)) for j in range(len(self.layer_ids))])

    def __getitem__(self, sample_id: str) -> Sample:
        from safetensors import safe_open

        with safe_open(shard_path(self.dir, self._shard_of[sample_id]), framework="pt") as f:
            return self._read(f, sample_id)

    def __iter__(self) -> Iterator[Sample]:
        from safetensors import safe_open

        for shard, rows in self.index.groupby("shard", sort=True):
            with safe_open(shard_path(self.dir, shard), framework="pt") as f:
                for sample_id in rows["sample_id"]:
                    yield self._read(f, sample_id)
