"""Room for the compressed tensors that shard writers keep in memory until each shard's end.

A compressed shard's digest is of the file in order, header first, and the header needs every tensor's compressed
size: so a writer keeps the shard's stored tensors until its end (`ShardFileWriter`). Without a bound, that is up to
`write_threads + 1` shards at once, each as large as its longest sample: host memory growing with sample length
times shards in flight. Here the writers of a capture share one limit: a shard's writer takes room for a sample's
states before encoding them, and waits while the room is taken by others (back-pressure: its samples hold the
pinned blocks, so the forward passes wait in turn).

The oldest shard in flight never waits. Its samples are complete first (a step holds rows of one shard, shards run
in order), so it can always finish, and waiting on it could stop the capture: the younger shards' samples would
hold the pinned blocks. So host memory for kept tensors is at most the limit plus the oldest shard's own bytes.
"""

from __future__ import annotations

import ctypes
import threading

from eagle_states.dataset.files import libc_function

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Have the C library give blocks of `threshold` bytes and more back to the system once freed (each is its own
    mapping). glibc by default raises that threshold to the largest block freed so far (up to 32 MiB); after that a
    codec's stored tensors (megabytes each, made and freed on every writer thread) come from its per-thread heaps,
    which keep what was freed, and the limit here would bound the tensors kept but not the process's memory (on the
    H200, nvcomp-ans at the DeepSeek-V3 width: peak RSS 15.8 GB above the loaded engine, 9.1 GB with this).
    Setting the threshold also turns that adjustment off. Process-wide, so for a process whose large host blocks
    are these (the CUDA capture's); False where there is no glibc `mallopt`."""
    mallopt = libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


class KeptBytes:
    """The limit shared by a capture's shard writers; `shard()` in the order the shards are captured."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.in_flight: list[ShardRoom] = []  # oldest first
        self.changed = threading.Condition()

    def shard(self) -> ShardRoom:
        """The next shard's room (called in capture order)."""
        room = ShardRoom(self)
        with self.changed:
            self.in_flight.append(room)
        return room

    def _take(self, room: ShardRoom, nbytes: int) -> None:
        with self.changed:
            while self.used + nbytes > self.limit and self.in_flight[0] is not room:
                self.changed.wait()
            self.used += nbytes
            room.held += nbytes

    def _give_back(self, room: ShardRoom, nbytes: int) -> None:
        with self.changed:
            self.used -= nbytes
            room.held -= nbytes
            self.changed.notify_all()

    def _close(self, room: ShardRoom) -> None:
        with self.changed:
            self.in_flight.remove(room)
            self.used -= room.held
            room.held = 0
            self.changed.notify_all()  # the next shard may be the oldest now


class ShardRoom:
    """One shard's share of a `KeptBytes`: `take` before encoding (may wait), `give_back` what an encoding did not
    need (a negative amount takes more without waiting: the bytes exist by then), `close` at the shard's end,
    whatever the outcome."""

    def __init__(self, kept: KeptBytes):
        self.kept = kept
        self.held = 0

    def take(self, nbytes: int) -> None:
        self.kept._take(self, nbytes)

    def give_back(self, nbytes: int) -> None:
        self.kept._give_back(self, nbytes)

    def close(self) -> None:
        self.kept._close(self)
