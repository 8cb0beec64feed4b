"""A sample too long for the capture's host buffer (`extract.host_buffer_gb`, `handoff.fits_host_buffer`), spilled: its
rows go to a file (in `extract.spill_dir`, or beside its shard) as each step is assembled, so that its steps' pinned
blocks are given back at once and host memory stays the setting's whatever the sample's length. Its shard's writer
streams each layer back in pieces of READ_BYTES when the sample's turn comes (`shard_file.StreamedTensor`).

Uncompressed (`SpillFile`), every captured layer has a region of its own. With a step codec (`EncodedSpillFile`), each
piece's encoded body is appended as it comes (its size is known only then) and what its tensor's frame needs ahead of
the bodies is kept in memory (`step_codecs.PieceHead`: fp8's per-row numbers, 12 bytes a row and layer); the shard's
digest, taken at its end, reads the bodies once more. A CPU codec's (Blosc2) are spilled uncompressed and compressed
as they are read back. The cost is one more write and read (two reads with a step codec) of the sample's stored
states: the page cache often serves the reads, and past the kernel's dirty-page limits the writes go to the disk too.
Reads nothing of vLLM."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
from typing import Iterator

import torch

from eagle_states import stopping
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.files import unnamed_file
from eagle_states.dataset.shard_file import StreamedTensor
from eagle_states.dataset.step_codecs import PieceHead, frame_head

READ_BYTES = 64 << 20  # a piece read back: two buffers of it per state streamed (`SpillFile._read`)
SPILL_DIR_REFUSED = ("its filesystem cannot make a file with no name (O_TMPFILE), which a spill file outside its "
                     "dataset must be, so that a crash leaves nothing there: choose a local disk, or leave it unset "
                     "(beside the shards)")


class SpillDirUnusable(ValueError):
    """`extract.spill_dir` cannot hold spill files."""


def check_spill_dir(directory: str) -> None:
    """`extract.spill_dir`, before the model loads: made if missing, and able to hold spill files."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd = unnamed_file(directory)
    except OSError as exc:
        raise SpillDirUnusable(f"extract.spill_dir {directory}: {exc.strerror}") from None
    if fd is None:
        raise SpillDirUnusable(f"extract.spill_dir {directory}: {SPILL_DIR_REFUSED}")
    os.close(fd)


def spill_file(shard_path: str, num_tokens: int, codec: Codec, directory: str | None = None) -> "SpillFile":
    """Where a sample of `num_tokens` rows is spilled, for a shard stored with `codec` (a step codec's as it encoded
    them; a CPU codec's uncompressed, compressed as the shard's writer reads them back); in `directory`
    (`extract.spill_dir`), or beside the shard."""
    if codec.on_device:
        return EncodedSpillFile(shard_path, num_tokens, codec.name, directory)
    return SpillFile(shard_path, num_tokens, directory)


class SpillFile:
    """One sample's states, [num_tokens, width] per captured layer, in a file with no name (`files.unnamed_file`)
    in `directory`, or beside its shard: nothing of it outlives the process, however that ends. Where the shard's
    filesystem cannot make one, a temp file named after the shard there, which a crashed run's next start removes
    like the shard's own temp file; a `directory` that cannot is refused before the model loads
    (`check_spill_dir`)."""

    def __init__(self, shard_path: str, num_tokens: int, directory: str | None = None):
        beside, name = os.path.split(shard_path)
        self.directory = directory or beside  # where the file is: a full disk's error names it
        os.makedirs(self.directory, exist_ok=True)
        self.fd, self.path = unnamed_file(self.directory), None
        if self.fd is None:
            if directory is not None:
                raise OSError(errno.EOPNOTSUPP, f"extract.spill_dir {directory}: {SPILL_DIR_REFUSED}")
            self.fd, self.path = stopping.temp_file(beside, f".{name}.spill-", ".tmp", readable=True)
        self.num_tokens = num_tokens
        self.dtype: torch.dtype | None = None  # the states', from the first rows added
        self.width = self.row_bytes = 0
        self.bytes = 0  # written so far

    def add(self, first_row: int, pieces: list[torch.Tensor]) -> None:
        """Rows from `first_row` on: a piece per captured layer, [rows, width] each."""
        if self.dtype is None:
            self.dtype, self.width = pieces[0].dtype, pieces[0].shape[-1]
            self.row_bytes = self.width * pieces[0].element_size()
        for slot, piece in enumerate(pieces):
            self._write_at(piece, (slot * self.num_tokens + first_row) * self.row_bytes)

    def _write_at(self, data: torch.Tensor, offset: int) -> None:
        data = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
        while data:  # a write may stop short (above 2 GiB, on a signal)
            try:
                done = os.pwrite(self.fd, data, offset)
            except OSError as exc:  # "No space left on device" names no file, and this one has no name
                raise OSError(exc.errno, f"{exc.strerror} (a sample spilled there)", self.directory) from exc
            data, offset = data[done:], offset + done
            self.bytes += done

    def _read(self, ranges: list[tuple[int, int]], block: int | None = None) -> Iterator[torch.Tensor]:
        """The file's bytes in each range (offset, nbytes) in turn, as uint8 tensors of at most `block` bytes
        (READ_BYTES by default), read into two buffers in turn: a piece is overwritten once the piece after next is
        made (`StreamedTensor`). A new buffer for each piece is a new mapping, its pages faulted in by the read: on
        the 2-core machine that took four times the read itself."""
        block = min(block or READ_BYTES, max([1, *(nbytes for _, nbytes in ranges)]))
        buffers = [torch.empty(block, dtype=torch.uint8) for _ in range(2)]
        for offset, nbytes in ranges:
            for start in range(offset, offset + nbytes, block):
                piece = buffers[0][:min(block, offset + nbytes - start)]
                buffers.reverse()
                view, at = memoryview(piece.numpy()), start
                while view:
                    done = os.preadv(self.fd, [view], at)
                    if done == 0:
                        raise EOFError(f"a spill file ends at byte {at}, before {offset + nbytes}")
                    view, at = view[done:], at + done
                yield piece

    def pieces(self, slot: int) -> Iterator[torch.Tensor]:
        """Layer `slot`'s rows, in order, as tensors of at most READ_BYTES each."""
        rows_per_piece = max(1, READ_BYTES // self.row_bytes)
        region = self._read([(slot * self.num_tokens * self.row_bytes, self.num_tokens * self.row_bytes)],
                            rows_per_piece * self.row_bytes)
        return (piece.view(self.dtype).view(-1, self.width) for piece in region)

    def stream(self, slot: int) -> StreamedTensor:
        """Layer `slot`'s state, for its shard's writer."""
        return StreamedTensor(functools.partial(self.pieces, slot), self.num_tokens)

    def close(self) -> None:
        """Remove the file (written, or abandoned); once."""
        if self.fd < 0:
            return
        os.close(self.fd)  # a file with no name goes with it
        self.fd = -1
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # a stop removed it
                pass
            stopping.untrack_temp(self.path)


class EncodedSpillFile(SpillFile):
    """One sample's states as a step codec encoded them on the device (`step_codecs`): per captured layer, its
    pieces in row order, their heads in memory and their bodies in the file."""

    def __init__(self, shard_path: str, num_tokens: int, codec_name: str, directory: str | None = None):
        super().__init__(shard_path, num_tokens, directory)
        self.codec_name = codec_name
        self.heads: list[list[tuple[PieceHead, int]]] = []  # per layer slot: (a piece's head, its body's offset)

    def add(self, first_row: int, pieces: list) -> None:
        """A step's pieces of this sample (`first_row` on, after the pieces added before), one per captured layer."""
        if self.dtype is None:
            self.dtype, self.width = pieces[0].dtype, pieces[0].shape[-1]
            self.heads = [[] for _ in pieces]
        for slot, piece in enumerate(pieces):
            head = piece.head()
            if head.aux is not None:  # a view of the step's pinned block, which goes back now
                head = dataclasses.replace(head, aux=head.aux.clone())
            self.heads[slot].append((head, self.bytes))
            self._write_at(piece.body, self.bytes)

    def stream(self, slot: int) -> StreamedTensor:
        """Layer `slot`'s state as its shard stores it, with the codec's record of it."""
        head, record = frame_head(self.codec_name, [h for h, _ in self.heads[slot]])
        return StreamedTensor(functools.partial(self._stored, head, slot), self.num_tokens, record)

    def _stored(self, head: list[torch.Tensor], slot: int) -> Iterator[torch.Tensor]:
        """The frame's head, then layer `slot`'s bodies read back."""
        yield from head
        yield from self._read([(offset, piece.stored) for piece, offset in self.heads[slot]])
