"""The codecs of the hidden states, part of the data contract: how an encoded tensor is stored inside a shard's
safetensors file, and how it is read back.

Blosc2 (`blosc2-zstd`, `blosc2-lz4`) compresses on the host, in the shard writers; the step codecs (`fp8-e4m3`,
lossy and opt-in; `nvcomp-ans`, lossless, CUDA; `fp8-e4m3-ans`, both) encode on the device before the copy
(`step_codecs.py`). All are stored the same way: a Blosc2 tensor is a `U8` safetensors entry holding one Blosc2
frame (`SChunk.to_cframe()`: chunks of `CHUNK_BYTES`, each split into its byte planes by Blosc2's shuffle filter,
then entropy-coded by zstd or lz4). Its logical dtype and shape, and a CRC-32 of the stored bytes, are in the file's
`__metadata__` (`ENCODED_KEY`), so a validator sees every tensor's logical layout from the header alone, and a
reader catches a damaged block (Blosc2 itself decodes most flipped bytes into wrong values without complaint). Only
the hidden states are compressed: token ids and loss masks are small and stay plain tensors.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # torch and numpy load when a tensor is encoded or decoded, not when settings are read
    import numpy as np
    import torch

CODEC_KEY = "eagle_states.codec"  # __metadata__: the codec's record (JSON)
ENCODED_KEY = "eagle_states.encoded"  # __metadata__: key -> {dtype, shape, crc32} of each compressed tensor (JSON)
CHUNK_BYTES = 8 << 20  # Blosc2 chunk: large enough for its blocks to find the byte planes' statistics
NAMES = ("none", "blosc2-zstd", "blosc2-lz4", "fp8-e4m3", "nvcomp-ans", "fp8-e4m3-ans")  # what `extract.codec` accepts
STEP_CODECS = ("fp8-e4m3", "nvcomp-ans", "fp8-e4m3-ans")  # encoded per engine step on the device (step_codecs.py)
LOSSY_CODECS = ("fp8-e4m3", "fp8-e4m3-ans")
# nvCOMP's ANS: encoded through its host API (which waits for its output sizes), decoded on a CUDA device only
NVCOMP_CODECS = ("nvcomp-ans", "fp8-e4m3-ans")
# the fp8 codec's bound on a layer's relative error (sqrt of the summed squared error over the summed squared
# norm): e4m3 keeps 3 mantissa bits, about 2.7 % on captured states; past this bound a layer is invalid
FP8_MAX_RELATIVE_ERROR = 0.05


def _blosc2():
    """Blosc2, set to release the GIL while it compresses: the shard writers compress beside the engine's loop,
    which must not wait for them (Blosc2 keeps the GIL by default: two writer threads ran no faster than one)."""
    import blosc2

    blosc2.set_releasegil(True)
    return blosc2


class CorruptTensorError(ValueError):
    """A compressed tensor whose stored bytes are not the ones written, or that does not decode to its shape."""


@dataclass(frozen=True)
class Codec:
    """`name`: one of NAMES; `level`: the entropy coder's level (1 = fastest); `threads`: Blosc2 threads per
    tensor (per writer thread, so a writer uses at most write_threads x threads cores). Level and name decide the
    bytes; threads do not (Blosc2 compresses its blocks independently)."""

    name: str = "none"
    level: int = 1
    threads: int = 1

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"codec {self.name!r}: use one of {', '.join(NAMES)}")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def on_device(self) -> bool:
        """Encoded per engine step where the states are computed, before the copy to the host."""
        return self.name in STEP_CODECS

    @property
    def lossy(self) -> bool:
        return self.name in LOSSY_CODECS

    def record(self) -> dict:
        """What the manifest and each shard's header say of the codec: enough to read the data and to know which
        library version made it."""
        if not self.enabled:
            return {"name": "none"}
        record = {"name": self.name}
        if self.lossy:
            record.update(lossy=True, scale="per token and layer: amax / 448, float32",
                          max_relative_error=FP8_MAX_RELATIVE_ERROR,
                          stored="scales float32 [T], then e4m3 codes [T, H]" if self.name == "fp8-e4m3" else
                          "scales float32 [T], then the e4m3 codes [T, H] in nvCOMP ANS buffers (bytes)")
        if self.name in NVCOMP_CODECS:
            from eagle_states.dataset.step_codecs import nvcomp_version

            record.update(algorithm="ANS", decodes_on="cuda", nvcomp=nvcomp_version())
        if self.name in STEP_CODECS:
            return record
        import blosc2

        return {"name": self.name, "level": self.level, "filter": "shuffle", "chunk_bytes": CHUNK_BYTES,
                "blosc2": blosc2.__version__}

    @property
    def entry_extras(self) -> tuple[str, ...]:
        """The numbers a compressed tensor's header entry holds beside its dtype, shape and CRC (`encoded_entry`)."""
        return LOSSY_ENTRY_EXTRAS if self.lossy else ()

    def encodes(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of this dtype is stored compressed (the floating-point states)."""
        return self.enabled and dtype.is_floating_point

    def frame(self, pieces: list) -> tuple[np.ndarray, dict]:
        """A step codec's pieces of one tensor (`step_codecs`), as stored, with what its entry records."""
        from eagle_states.dataset import step_codecs

        return step_codecs.frame(self.name, pieces)

    def encode(self, pieces: Iterable[torch.Tensor], itemsize: int) -> bytes:
        """The pieces' concatenation along dim 0 (of `itemsize` bytes an element), compressed into one Blosc2 frame
        a chunk of CHUNK_BYTES at a time as they come: held in memory, or streamed from a spill file. A piece's
        whole chunks are compressed where they lie; only a chunk across two pieces is copied first. The frame is
        the one Blosc2 makes of the whole tensor at once (with one thread: with more, Blosc2's own bytes vary from
        run to run once a chunk holds several of its blocks)."""
        import numpy as np
        import torch

        blosc2 = _blosc2()
        cparams = {"codec": blosc2.Codec.ZSTD if self.name == "blosc2-zstd" else blosc2.Codec.LZ4,
                   "clevel": self.level, "filters": [blosc2.Filter.SHUFFLE], "typesize": itemsize,
                   "nthreads": self.threads}
        frame = blosc2.SChunk(chunksize=CHUNK_BYTES, cparams=cparams)
        across, filled = None, 0  # the chunk that pieces end inside, and its bytes so far
        for piece in pieces:
            flat = piece.contiguous().view(torch.uint8).reshape(-1).numpy()
            if filled:
                n = min(CHUNK_BYTES - filled, flat.size)
                across[filled:filled + n], filled, flat = flat[:n], filled + n, flat[n:]
                if filled == CHUNK_BYTES:
                    frame.append_data(across)
                    filled = 0
            whole = flat.size // CHUNK_BYTES * CHUNK_BYTES if not filled else 0
            for start in range(0, whole, CHUNK_BYTES):
                frame.append_data(flat[start:start + CHUNK_BYTES])
            if whole < flat.size:
                across = across if across is not None else np.empty(CHUNK_BYTES, np.uint8)
                across[:flat.size - whole], filled = flat[whole:], flat.size - whole
        if filled:
            frame.append_data(across[:filled])
        return frame.to_cframe()


# what a lossy codec records of each tensor (`step_codecs.frame_head`): its rounding error and the states' norm,
# squared and summed
LOSSY_ENTRY_EXTRAS = ("sq_err", "sq_sum")


def encoded_entry(dtype_code: str, shape: list[int], crc32: int, extra: dict | None = None) -> dict:
    """The header metadata of one compressed tensor: its logical dtype and shape, the stored bytes' CRC-32
    (`zlib.crc32`), and what its codec records of it (fp8: the squared error and norm)."""
    return {"dtype": dtype_code, "shape": list(shape), "crc32": crc32, **(extra or {})}


def header_metadata(codec: Codec, encoded: dict[str, dict]) -> dict[str, str]:
    """The shard's `__metadata__` entries for a compressed shard (safetensors metadata values are strings)."""
    if not codec.enabled:
        return {}
    return {CODEC_KEY: json.dumps(codec.record(), sort_keys=True, separators=(",", ":")),
            ENCODED_KEY: json.dumps(encoded, sort_keys=True, separators=(",", ":"))}


def read_header_metadata(metadata: dict | None) -> tuple[dict, dict[str, dict]]:
    """(the codec's record, key -> encoded entry) from a shard's `__metadata__`; ({"name": "none"}, {}) for a
    plain shard."""
    metadata = metadata or {}
    codec = json.loads(metadata[CODEC_KEY]) if CODEC_KEY in metadata else {"name": "none"}
    encoded = json.loads(metadata[ENCODED_KEY]) if ENCODED_KEY in metadata else {}
    return codec, encoded


def decode(stored: np.ndarray, entry: dict, dtype: torch.dtype, threads: int = 1, codec: str = "blosc2-zstd"
           ) -> torch.Tensor:
    """The tensor a compressed entry holds (bit-exact but for fp8), after checking the stored bytes' CRC-32 and
    the decoded size. `stored`: the entry's bytes as a uint8 array; `codec`: the shard's codec name."""
    key_shape = entry["shape"]
    if zlib.crc32(stored) != entry["crc32"]:
        raise CorruptTensorError(f"stored bytes fail their CRC-32 check ({len(stored):,} bytes)")
    if codec in STEP_CODECS:
        from eagle_states.dataset import step_codecs

        try:
            return step_codecs.DECODERS[codec](stored, key_shape, dtype)
        except ValueError as exc:
            raise CorruptTensorError(f"does not decode: {exc}") from None
    blosc2 = _blosc2()
    import torch

    out = torch.empty(key_shape, dtype=dtype)
    flat = out.view(torch.uint8).reshape(-1).numpy()
    try:
        frame = blosc2.schunk_from_cframe(stored, copy=False)
        frame.dparams = blosc2.DParams(nthreads=threads)
        if frame.nbytes != flat.nbytes:
            raise CorruptTensorError(f"decodes to {frame.nbytes:,} bytes, the shape {key_shape} needs {flat.nbytes:,}")
        frame.get_slice(0, flat.nbytes // frame.typesize, out=flat)
    except CorruptTensorError:
        raise
    except Exception as exc:  # Blosc2 raises RuntimeError/ValueError on a frame it cannot parse
        raise CorruptTensorError(f"does not decode: {exc}") from exc
    return out

