"""A sample too long for the capture's host buffer (`extract.host_buffer_gb`, `handoff.fits_host_buffer`), spilled:
its rows go to a file beside its shard as each step is assembled, every captured layer in a region of its own, so
that its steps' pinned blocks are given back at once and host memory stays the setting's whatever the sample's
length. Its shard's writer reads each layer back in pieces of READ_BYTES when the sample's turn comes. The cost is
one more write and read of its states (the page cache often serves the read). Reads nothing of vLLM."""

from __future__ import annotations

import os
from typing import Iterator

import torch

from eagle_states import stopping

READ_BYTES = 64 << 20  # a piece read back: two at most are in memory (`ShardFileWriter.write_streamed`)


class SpillFile:
    """One sample's states, [num_tokens, width] per captured layer, in a temp file named after its shard (so that
    a crashed run's is removed like the shard's own temp file)."""

    def __init__(self, shard_path: str, num_tokens: int):
        directory, name = os.path.split(shard_path)
        os.makedirs(directory, exist_ok=True)
        self.fd, self.path = stopping.temp_file(directory, f".{name}.spill-", ".tmp")
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
            data = memoryview(piece.contiguous().view(torch.uint8).numpy()).cast("B")
            offset = (slot * self.num_tokens + first_row) * self.row_bytes
            while data:  # a write may stop short (above 2 GiB, on a signal)
                done = os.pwrite(self.fd, data, offset)
                data, offset = data[done:], offset + done
                self.bytes += done

    def pieces(self, slot: int) -> Iterator[torch.Tensor]:
        """Layer `slot`'s rows, in order, as tensors of at most READ_BYTES each."""
        rows_per_piece = max(1, READ_BYTES // self.row_bytes)
        with open(self.path, "rb", buffering=0) as f:
            for start in range(0, self.num_tokens, rows_per_piece):
                rows = min(rows_per_piece, self.num_tokens - start)
                buffer = bytearray(rows * self.row_bytes)
                view, offset = memoryview(buffer), (slot * self.num_tokens + start) * self.row_bytes
                while view:
                    done = os.preadv(f.fileno(), [view], offset)
                    if done == 0:
                        raise EOFError(f"{self.path}: layer slot {slot} ends before row {self.num_tokens}")
                    view, offset = view[done:], offset + done
                yield torch.frombuffer(buffer, dtype=torch.uint8).view(self.dtype).view(rows, self.width)

    def close(self) -> None:
        """Remove the file (written, or abandoned); once."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # a stop removed it
            pass
        stopping.untrack_temp(self.path)
