"""Codecs applied to a whole engine step on the device that computed it, before the device-to-host copy (fewer bytes
over PCIe, through the pinned buffers and to the disk), and how their tensors are framed in a shard and read back.

A step's states arrive stacked, [L, R, H] (layer slot, row, width). Rows belong to samples in spans the capture
knows on the host before the step runs; a sample's tensor in the shard is the concatenation of its spans' pieces,
so a step codec must encode row spans independently:

* `fp8-e4m3` (lossy, opt-in): each row (one token's state at one layer) scaled by amax / 448 into float8 e4m3,
  the scale kept in float32; with the rounding error of each row (squared, summed) and the row's squared norm, so
  that how lossy it was is measured on the true states and recorded per tensor (validation sums it per layer).
  Stored: scales float32 [T], then e4m3 [T, H]. Read back in the dataset's dtype (bf16 on a GPU).
* `nvcomp-ans` (lossless, CUDA only): nvCOMP's ANS on each (layer, span), typed as the states' float type
  (`<f2` for bf16/fp16, `<f4` for fp32: ANS codes the exponent bytes' skew). Stored: a count, each nvCOMP
  buffer's stored and decoded size, then the buffers (nvCOMP's native bitstream). nvCOMP decodes on a CUDA device
  only: a machine without one reads the exports made from such a dataset, not the dataset. The buffers follow how
  the scheduler split a sample into steps, so a shard computed again holds the same states in other bytes.
* `fp8-e4m3-ans` (lossy, opt-in, CUDA only): fp8-e4m3's codes and scales, the codes of each (layer, span) then coded
  by nvCOMP's ANS as bytes (e4m3's exponent bits are skewed like bf16's: about 1.18 x more). Stored: scales float32
  [T], then the codes' nvCOMP buffers framed as nvcomp-ans frames them. Decodes on a CUDA device only, as
  nvcomp-ans; its bytes follow the scheduler's steps in the same way.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from eagle_states.dataset.codec import LOSSY_CODECS, LOSSY_ENTRY_EXTRAS, NVCOMP_CODECS

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
FP8_AUX = 3  # per row: scale, squared rounding error, squared norm (float32)
NVCOMP_TYPES = {torch.bfloat16: "<f2", torch.float16: "<f2", torch.float32: "<f4", torch.uint8: "|u1"}
# the torch dtype nvCOMP's batch entries are carved as, by element size: an entry takes its type from its buffer
NVCOMP_VIEWS = {1: torch.uint8, 2: torch.float16, 4: torch.float32}


class CodecUnavailable(RuntimeError):
    """A codec this machine cannot run (nvCOMP without a CUDA device or without the package)."""


def nvcomp_module():
    try:
        from nvidia import nvcomp
    except ImportError:
        raise CodecUnavailable(f"{' and '.join(NVCOMP_CODECS)} need nvCOMP's Python package: pip install "
                               "nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 (or eagle-states[gpu-codec])") from None
    return nvcomp


def require_decoder(what, codec_name: str) -> None:
    """Data stored with `codec_name` is read where it can be decoded, or refused at once, saying so: an nvCOMP
    codec's needs a CUDA device and nvCOMP."""
    if codec_name not in NVCOMP_CODECS:
        return
    if not torch.cuda.is_available():
        raise CodecUnavailable(f"{what} is stored with {codec_name}, which decodes on a CUDA device only: read it on "
                               "a GPU machine, or the exports made from it (eagle-states export) anywhere")
    nvcomp_module()


def nvcomp_version() -> str:
    return nvcomp_module().__version__


# ---------------------------------------------------------------------------------------------------------------
# Pieces: a span of rows of one layer slot, after the copy (views of the host step)
# A piece has the `shape` ([rows, H]) and `dtype` of the states it stands for, as the shard writer reads a plain
# piece's. A tensor's stored bytes are a head made from its pieces' `PieceHead`s (`frame_head`), then each piece's
# `body` in order: so a spilled sample's pieces are framed from heads kept in memory and bodies read back from its
# file (`capture.spill`), into the bytes the pieces held in memory give.
@dataclass(frozen=True)
class PieceHead:
    """What a tensor's frame says of one of its pieces ahead of the bodies."""
    stored: int  # its body's bytes
    decoded_bytes: int  # what its body decodes to
    aux: torch.Tensor | None  # fp8's per-row numbers, float32 [rows, FP8_AUX]; None for nvcomp-ans


@dataclass(frozen=True)
class Fp8Piece:
    codes: torch.Tensor  # uint8 [r, H]: e4m3 bit patterns
    aux: torch.Tensor  # float32 [r, FP8_AUX]
    dtype: torch.dtype  # of the states (what the reader gives back)

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def body(self) -> torch.Tensor:
        return self.codes.reshape(-1)

    def head(self) -> PieceHead:
        return PieceHead(self.codes.numel(), self.codes.numel(), self.aux)


@dataclass(frozen=True)
class NvcompPiece:
    blob: torch.Tensor  # uint8: one nvCOMP native buffer
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.width

    @property
    def decoded_bytes(self) -> int:
        return self.rows * self.width * self.dtype.itemsize

    @property
    def body(self) -> torch.Tensor:
        return self.blob

    def head(self) -> PieceHead:
        return PieceHead(self.blob.numel(), self.decoded_bytes, None)


@dataclass(frozen=True)
class Fp8AnsPiece(NvcompPiece):
    """`blob`: the nvCOMP buffer of the span's e4m3 codes."""
    aux: torch.Tensor  # float32 [rows, FP8_AUX]

    @property
    def decoded_bytes(self) -> int:
        return self.rows * self.width  # a byte per code

    def head(self) -> PieceHead:
        return PieceHead(self.blob.numel(), self.decoded_bytes, self.aux)


class Fp8Rows:
    """One layer slot of an fp8 step on the host: sliced by rows like the plain states."""

    def __init__(self, codes: torch.Tensor, aux: torch.Tensor, dtype: torch.dtype):
        self.codes, self.aux, self.dtype = codes, aux, dtype

    def __getitem__(self, rows: slice) -> Fp8Piece:
        return Fp8Piece(self.codes[rows], self.aux[rows], self.dtype)


class NvcompRows:
    """One layer slot of an nvCOMP step on the host: the spans it was encoded in, each one piece. Only those exact
    spans can be taken (the capture encodes the spans it will assemble)."""

    def __init__(self, pieces: dict[tuple[int, int], NvcompPiece]):
        self.pieces = pieces

    def __getitem__(self, rows: slice) -> NvcompPiece:
        try:
            return self.pieces[(rows.start, rows.stop)]
        except KeyError:
            raise ValueError(f"rows {rows.start}:{rows.stop} were not encoded as one span (spans: "
                             f"{sorted(self.pieces)[:4]}...)") from None


# ---------------------------------------------------------------------------------------------------------------
# On the device: a step in, one flat uint8 tensor out (one copy to the host), and how to slice it back
@dataclass(frozen=True)
class EncodedStep:
    data: torch.Tensor  # uint8, 1-D, on the step's device
    layers: int
    rows: int
    width: int
    dtype: torch.dtype  # of the states
    spans: tuple[tuple[int, int], ...] = ()  # nvCOMP codecs: the encoded row spans
    sizes: tuple[int, ...] = ()  # nvCOMP codecs: the bytes of each (layer, span) buffer, layer-major

    def host_rows(self, host: torch.Tensor, codec_name: str) -> list:
        """Per layer slot, the rows of this step in `host` (the copy of `data`), as the assembler slices them."""
        if codec_name == "fp8-e4m3":
            n = self.layers * self.rows * self.width
            codes = host[:n].view(self.layers, self.rows, self.width)
            auxes = self._aux(host, _float_aligned(n))
            return [Fp8Rows(codes[slot], aux, self.dtype) for slot, aux in enumerate(auxes)]
        auxes = self._aux(host, _float_aligned(sum(self.sizes))) if codec_name == "fp8-e4m3-ans" else None
        out, offset, sizes = [], 0, iter(self.sizes)
        for slot in range(self.layers):
            pieces = {}
            for start, stop in self.spans:
                size = next(sizes)
                blob = host[offset:offset + size]
                pieces[(start, stop)] = (NvcompPiece(blob, stop - start, self.width, self.dtype) if auxes is None else
                                         Fp8AnsPiece(blob, stop - start, self.width, self.dtype,
                                                     auxes[slot][start:stop]))
                offset += size
            out.append(NvcompRows(pieces))
        return out

    def _aux(self, host: torch.Tensor, at: int) -> torch.Tensor:
        """fp8's per-row (scale, squared error, squared norm), [L, R, FP8_AUX], stored in `host` from byte `at`."""
        n = self.layers * self.rows * FP8_AUX * 4
        return host[at:at + n].view(torch.float32).view(self.layers, self.rows, FP8_AUX)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States [..., H] -> e4m3 codes (uint8 [..., H]) and per-row (scale, squared error, squared norm) (float32
    [..., FP8_AUX]), computed in float32."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    error = (x - q.float() * scale).square().sum(dim=-1)
    return q.view(torch.uint8), torch.stack([scale.squeeze(-1), error, x.square().sum(dim=-1)], dim=-1)


@functools.cache
def _fused_fp8_quantize():
    """`fp8_quantize` compiled (Inductor's fused kernels read the states and write codes and row numbers, no float32
    temporaries): eager, it moves about 90 bytes per value through a dozen kernels; on the H200 the forward passes
    beside it ran 9 % slower eager and as fast as without it compiled (306 GB/s against 67, bench/RESULTS.md). The
    first call compiles it (seconds, once per process; Inductor caches it on disk for the next); `dynamic`: a
    step's row count changes from step to step."""
    return torch.compile(fp8_quantize, dynamic=True, fullgraph=True)


def fp8_rows(stacked: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, R, H] states -> e4m3 codes (uint8 [L, R, H]) and per-row numbers (float32 [L, R, FP8_AUX]). `fused`
    (default: on a CUDA device) compiled over all layers at once; else eager, a layer at a time (the temporaries
    are one layer's), as the CPU build runs it."""
    if stacked.is_cuda if fused is None else fused:
        return _fused_fp8_quantize()(stacked)
    layers, rows, width = stacked.shape
    codes = torch.empty((layers, rows, width), dtype=torch.uint8, device=stacked.device)
    aux = torch.empty((layers, rows, FP8_AUX), dtype=torch.float32, device=stacked.device)
    for slot in range(layers):
        codes[slot], aux[slot] = fp8_quantize(stacked[slot])
    return codes, aux


def _packed(data: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """A step's bytes (codes or nvCOMP buffers), then its per-row numbers 4-byte aligned, in one tensor."""
    pad = data.new_zeros(_float_aligned(data.numel()) - data.numel())
    return torch.cat([data.reshape(-1), pad, aux.reshape(-1).view(torch.uint8)])


def fp8_encode_step(stacked: torch.Tensor, fused: bool | None = None) -> EncodedStep:
    """[L, R, H] states -> e4m3 codes and per-row (scale, squared error, squared norm), packed in one tensor
    (`fused`: as `fp8_rows`)."""
    codes, aux = fp8_rows(stacked, fused)
    return EncodedStep(_packed(codes, aux), *stacked.shape, stacked.dtype)


def fp8_ans_encode_step(stacked: torch.Tensor, spans: list[tuple[int, int]], ans: NvcompStepEncoder,
                        quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> EncodedStep:
    """fp8-e4m3's codes and per-row numbers (`quantized`: made already by `fp8_rows`), the codes of each (layer,
    span) coded by `ans` as bytes; stored: the buffers, then the per-row numbers (as fp8-e4m3 stores them after
    its codes)."""
    codes, aux = quantized if quantized is not None else fp8_rows(stacked)
    coded = ans(codes, spans)
    return EncodedStep(_packed(coded.data, aux), *stacked.shape, stacked.dtype, coded.spans, coded.sizes)


def _float_aligned(nbytes: int) -> int:
    """Where fp8's per-row float32 numbers start after `nbytes` of codes or nvCOMP buffers in a step's data (a
    float view needs 4-byte alignment)."""
    return -(-nbytes // 4) * 4


def _aligned(sizes: list[int], align: int = 256) -> list[int]:
    """Offsets of entries of these sizes laid end to end, each aligned (nvCOMP's buffers need aligned starts)."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // align) * align
    return offsets + [at]


class NvcompStepEncoder:
    """nvCOMP ANS on a step's (layer, span) buffers, in one batched call on `stream` (the capture's encoder stream,
    from its assembler thread, beside the next forward pass; the caller has waited for the step's states). One per
    capture: an nvCOMP codec is not shared between threads. Input and output are carved from torch tensors
    (`as_arrays` with an offset table): nvCOMP 6.0.0's own batch entries, taken through DLPack, corrupted the host
    heap (bench/RESULTS.md). The states' float type, or bytes (fp8-e4m3-ans's codes)."""

    # nvCOMP lets go of a batch of arrays with a device-wide wait (cudaFree) holding the GIL: the forward thread then
    # launches nothing until the model's queued kernels are done (measured: 41 ms behind 50 ms of work on another
    # stream, bench/nvcomp_gil_check.py). Spent batches are kept and let go of together, one such wait per this many;
    # they are views of buffers kept here (`inp`, `out`), never of a step's own tensor, which they would keep alive.
    RELEASE_EVERY = 64

    def __init__(self, stream: torch.cuda.Stream):
        self.nvcomp = nvcomp_module()
        self.stream = stream
        self.codecs = {}
        self.inp = torch.empty(0, dtype=torch.uint8, device="cuda")  # reused: steps are encoded one at a time
        self.out = torch.empty(0, dtype=torch.uint8, device="cuda")
        self.spent: list = []  # (input, output) nvCOMP arrays of encoded steps, until RELEASE_EVERY of them

    def __call__(self, stacked: torch.Tensor, spans: list[tuple[int, int]]) -> EncodedStep:
        nvcomp = self.nvcomp
        layers, rows, width = stacked.shape
        data_type = NVCOMP_TYPES[stacked.dtype]
        codec = self.codecs.get(data_type)
        if codec is None:
            codec = self.codecs[data_type] = nvcomp.Codec(algorithm="ANS", data_type=data_type,
                                                          cuda_stream=self.stream.cuda_stream)
        row_bytes = width * stacked.element_size()
        # typed as the codec's data type (the batch's entries take their type from the buffer; bf16 has no
        # array-protocol type of its own, and ANS codes 16-bit floats by their bits); offsets and sizes in bytes
        nbytes = stacked.numel() * stacked.element_size()
        if self.inp.numel() < nbytes:
            self.inp = torch.empty(nbytes, dtype=torch.uint8, device=stacked.device)
        with torch.cuda.stream(self.stream):
            self.inp[:nbytes].copy_(stacked.reshape(-1).view(torch.uint8))
        flat = self.inp[:nbytes].view(NVCOMP_VIEWS[stacked.element_size()])
        offsets = [(slot * rows + start) * row_bytes for slot in range(layers) for start, _ in spans]
        sizes = [(stop - start) * row_bytes for _ in range(layers) for start, stop in spans]
        # the capacity nvCOMP asks for (its bound on incompressible data): 1.17 x for 16-bit floats, 1.42 x for bytes
        room = [size + size // 2 + (1 << 20) for size in sizes]
        out_offsets = _aligned(room)
        if self.out.numel() < out_offsets[-1]:
            self.out = torch.empty(out_offsets[-1], dtype=torch.uint8, device=stacked.device)
        if len(self.spent) >= self.RELEASE_EVERY:
            self.spent.clear()
        out = nvcomp.as_arrays(self.out, out_offsets[:-1], room, cuda_stream=self.stream.cuda_stream)
        src = nvcomp.as_arrays(flat, offsets, sizes, cuda_stream=self.stream.cuda_stream)
        self.spent.append((src, out))
        codec.encode(src, out=out)
        # wait for the encoder through torch, which lets go of the GIL while it waits: nvCOMP's `buffer_sizes`
        # waits holding it, and the forward thread, which launches the model's kernels one by one, stops meanwhile
        encoded = torch.cuda.Event()
        encoded.record(self.stream)
        encoded.synchronize()
        stored = out.buffer_sizes
        data = torch.cat([self.out[at:at + size] for at, size in zip(out_offsets, stored)])
        return EncodedStep(data, layers, rows, width, stacked.dtype, tuple(spans), tuple(stored))


# ---------------------------------------------------------------------------------------------------------------
# In the shard: a tensor's pieces framed into its stored bytes, and read back
# Framed by torch.cat, which lets go of the GIL while it copies (numpy's tobytes and bytes.join hold it): eight
# writer threads frame each step's tensors while vLLM launches the model's kernels from a Python thread
# (bench/framing_gil_check.py). The stored bytes are a uint8 array.
def _fp8_scales(heads: list[PieceHead]) -> tuple[torch.Tensor, dict]:
    """The scales' stored bytes (float32 [T]) and the entry's error record (sums of squares, float64)."""
    aux = torch.cat([h.aux for h in heads]) if len(heads) > 1 else heads[0].aux
    # a copy: `contiguous` keeps a one-row column's stride, which the byte view refuses
    scales = aux[:, 0].clone(memory_format=torch.contiguous_format).view(torch.uint8)
    return scales, dict(zip(LOSSY_ENTRY_EXTRAS, aux[:, 1:].double().sum(dim=0).tolist()))


def _nvcomp_head(heads: list[PieceHead]) -> torch.Tensor:
    """A count, then each buffer's stored and decoded size (the buffers follow)."""
    sizes = [n for h in heads for n in (h.stored, h.decoded_bytes)]
    return torch.frombuffer(bytearray(struct.pack(f"<I{len(sizes)}Q", len(heads), *sizes)), dtype=torch.uint8)


def frame_head(codec_name: str, heads: list[PieceHead]) -> tuple[list[torch.Tensor], dict]:
    """What a tensor stored with `codec_name` holds before its pieces' bodies, and the entry's record of it: fp8's
    scales (fp8-e4m3: then the codes), nvCOMP's frame (nvcomp-ans: then the buffers), or both in that order
    (fp8-e4m3-ans: then the codes' buffers)."""
    parts, record = [], {}
    if codec_name in LOSSY_CODECS:
        scales, record = _fp8_scales(heads)
        parts.append(scales)
    if codec_name in NVCOMP_CODECS:
        parts.append(_nvcomp_head(heads))
    return parts, record


def frame(codec_name: str, pieces: list) -> tuple[np.ndarray, dict]:
    """A tensor's pieces (`Fp8Piece`, `NvcompPiece` or `Fp8AnsPiece`, as `codec_name` made them) as stored, and the
    entry's record of them."""
    head, record = frame_head(codec_name, [p.head() for p in pieces])
    return torch.cat([*head, *(p.body for p in pieces)]).numpy(), record


def _from_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes (uint8 [T, H]) times their rows' float32 scales, in `dtype`."""
    return (codes.view(torch.float8_e4m3fn).float() * scales[:, None]).to(dtype)


def decode_fp8(stored: np.ndarray, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    tokens, width = shape
    if stored.nbytes != tokens * 4 + tokens * width:
        raise ValueError(f"{stored.nbytes:,} bytes, an fp8 tensor of shape {shape} has {tokens * (4 + width):,}")
    data = torch.from_numpy(stored)
    return _from_fp8(data[tokens * 4:].view(tokens, width), data[:tokens * 4].view(torch.float32), dtype)


def nvcomp_buffers(stored: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
    """The nvCOMP buffers of a stored tensor and their decoded sizes (the frame checked against its length)."""
    if stored.nbytes < 4:
        raise ValueError("shorter than its frame")
    (count,) = struct.unpack_from("<I", stored)
    head = 4 + 16 * count
    if stored.nbytes < head:
        raise ValueError(f"a frame of {count} buffers in {stored.nbytes:,} bytes")
    sizes = struct.unpack_from(f"<{2 * count}Q", stored, 4)
    lengths, decoded = list(sizes[0::2]), list(sizes[1::2])
    if head + sum(lengths) != stored.nbytes:
        raise ValueError(f"buffers of {head + sum(lengths):,} bytes with their frame, {stored.nbytes:,} stored")
    ends = np.cumsum([head, *lengths])
    return [stored[ends[i]:ends[i + 1]] for i in range(count)], decoded


def _nvcomp_decode(stored: np.ndarray, shape: list[int], dtype: torch.dtype, codec_name: str) -> torch.Tensor:
    """An nvCOMP frame's buffers (of a tensor stored with `codec_name`) decoded on the CUDA device (nvCOMP's ANS
    has no host decoder) as the type they were encoded as (`dtype`'s), into a tensor of `shape` there."""
    buffers, decoded = nvcomp_buffers(stored)
    nbytes = math.prod(shape) * dtype.itemsize
    if sum(decoded) != nbytes:
        raise ValueError(f"decodes to {sum(decoded):,} bytes, the shape {shape} needs {nbytes:,}")
    require_decoder("this tensor", codec_name)
    nvcomp = nvcomp_module()
    lengths = [b.nbytes for b in buffers]
    src_offsets, out_offsets = _aligned(lengths), _aligned(decoded)
    src = torch.zeros(src_offsets[-1], dtype=torch.uint8)
    for at, buffer in zip(src_offsets, buffers):
        src[at:at + buffer.nbytes] = torch.frombuffer(buffer, dtype=torch.uint8)
    src = src.cuda()
    dst = torch.empty(out_offsets[-1], dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    # decoded as the type it was encoded as (without it, ANS decodes the bytes as bytes: wrong values)
    codec = nvcomp.Codec(algorithm="ANS", data_type=NVCOMP_TYPES[dtype], cuda_stream=stream)
    result = nvcomp.as_arrays(dst, out_offsets[:-1], decoded, cuda_stream=stream)
    codec.decode(nvcomp.as_arrays(src, src_offsets[:-1], lengths, cuda_stream=stream), out=result)
    if list(result.buffer_sizes) != decoded:
        raise ValueError(f"buffers decode to {list(result.buffer_sizes)} bytes, the frame says {decoded}")
    return torch.cat([dst[at:at + size] for at, size in zip(out_offsets, decoded)]).view(dtype).view(shape)


def decode_nvcomp(stored: np.ndarray, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return _nvcomp_decode(stored, shape, dtype, "nvcomp-ans").cpu()


def decode_fp8_ans(stored: np.ndarray, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The codes decoded and scaled on the CUDA device (the same arithmetic as `decode_fp8`, the same values)."""
    tokens, _ = shape
    if stored.nbytes < tokens * 4:
        raise ValueError(f"{stored.nbytes:,} bytes, shorter than the {tokens:,} scales of shape {shape}")
    codes = _nvcomp_decode(stored[tokens * 4:], shape, torch.uint8, "fp8-e4m3-ans")
    scales = torch.from_numpy(stored[:tokens * 4]).view(torch.float32).to(codes.device)
    return _from_fp8(codes, scales, dtype).cpu()


# by codec name: a tensor's stored bytes read back
DECODERS = {"fp8-e4m3": decode_fp8, "nvcomp-ans": decode_nvcomp, "fp8-e4m3-ans": decode_fp8_ans}
