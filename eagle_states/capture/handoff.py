"""What the capture's threads hand each other: the forward thread's steps (to the assembler), the assembler's
samples and shard plans (to the shard writers), and the pinned blocks they share. Nothing here reads vLLM."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from eagle_states.dataset.codec import Codec

if TYPE_CHECKING:
    from eagle_states.capture.forward import PinnedPool
    from eagle_states.capture.spill import SpillFile


def pinned_blocks(budget_bytes: int, row_bytes: int, max_num_tokens: int) -> tuple[int, int]:
    """(bytes per block, blocks) of the pinned pool: a block holds one step of `max_num_tokens` rows of
    `row_bytes` (every captured layer) with room for a step codec's framing; at least 4 blocks."""
    capacity = row_bytes * max_num_tokens
    capacity += capacity // 64 + (1 << 20)  # a step codec's framing on incompressible states
    return capacity, max(4, budget_bytes // capacity)


def blocks_held(num_tokens: int, max_num_tokens: int) -> int:
    """The pinned blocks a sample of `num_tokens` prompt rows can hold at once while it is captured in memory:
    every step its rows span (it is written once complete), and the next step's."""
    return -(-num_tokens // max_num_tokens) + 2


def fits_host_buffer(num_tokens: int, budget_bytes: int, row_bytes: int, max_num_tokens: int) -> bool:
    """Whether a sample is held in the pinned pool from its first step to its last; one that is not would wait
    forever for room, so its rows go to a spill file as they are captured (`spill`). The driver and the capture
    worker both decide by this."""
    return blocks_held(num_tokens, max_num_tokens) <= pinned_blocks(budget_bytes, row_bytes, max_num_tokens)[1]


@dataclass(slots=True, eq=False)
class PinnedBlock:
    """A pinned host buffer holding one step's states; back in the pool once every sample using it is written."""
    buffer: torch.Tensor
    refs: int = 0
    nbytes: int = 0  # the step's bytes in it


@dataclass(frozen=True, slots=True)
class StepRequest:
    """A captured request's rows in a step: rows [start, end) of the step belong to sample `sample_id`."""
    sample_id: str  # a generating request's key until `FinishGeneration` names its sample
    start: int
    end: int
    prompt_len: int
    generating: bool  # captured while it generates: its decode rows are kept
    computed: int  # the request's rows computed before this step (its first row's position)

    @property
    def prompt_rows(self) -> tuple[int, int]:
        """The rows of the step that are prompt rows (a prefill's last step may end with a decode row)."""
        return self.start, min(self.end, self.start + self.prompt_len - self.computed)


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """One forward pass's rows, on the host once `copied` has completed (None: they already are)."""
    requests: list[StepRequest]
    positions: torch.Tensor
    input_ids: torch.Tensor
    states: list | None  # one per captured layer, rows sliceable (tensors, or a step codec's rows); None on ranks
    # that do not write
    block: PinnedBlock | None  # the pinned block `states` live in (CUDA)
    copied: torch.cuda.Event | None
    # a step codec that waits for its own output (nvcomp-ans): the assembler runs this first, off the forward path;
    # it returns the step with its states on the host
    finish: Callable[[], "Step"] | None = None


@dataclass(slots=True, eq=False)
class PartialSample:
    """A sample being assembled from its steps' rows (views into their states, no copies)."""
    next: int = 0  # the position its next rows start at
    ids: list[torch.Tensor] = field(default_factory=list)
    chunks: list[list[torch.Tensor]] = field(default_factory=list)  # per step: a piece per layer
    blocks: list[PinnedBlock] = field(default_factory=list)  # the pinned blocks `chunks` are views of
    spill: SpillFile | None = None  # where its rows go instead (a sample too long for the pinned pool)

    def add_states(self, step: Step, start: int, keep: int, pinned: PinnedPool) -> None:
        """The step's rows [start, keep), which are this sample's from position `next` on, of every captured
        layer: views into the step's pinned block, which the sample then holds, or written to its spill file."""
        pieces = [s[start:keep] for s in step.states]  # views: no copy
        if self.spill is not None:
            self.spill.add(self.next, pieces)  # the block goes back with the step's own reference
            return
        self.chunks.append(pieces)
        if step.block is not None:
            pinned.hold(step.block)
            self.blocks.append(step.block)

    def forget(self, pinned: PinnedPool) -> None:
        """An abandoned sample's pinned blocks back, its spill file removed."""
        pinned.release(self.blocks)
        if self.spill is not None:
            self.spill.close()


@dataclass(slots=True, eq=False)
class CapturedSample:
    """A complete sample, until its shard's writer has written it."""
    ids: torch.Tensor
    chunks: list[list[torch.Tensor]] | None  # per piece: a tensor per layer; None once its blocks are given back
    blocks: list[PinnedBlock]
    spill: SpillFile | None = None  # its states instead of `chunks`, for a sample too long for the pinned pool

    def state_width_and_dtype(self) -> tuple[int, torch.dtype]:
        """Its hidden states' width and dtype (a step codec's: the states it encoded)."""
        if self.spill is not None:
            return self.spill.width, self.spill.dtype
        like = self.chunks[0][0]
        return like.shape[-1], like.dtype

    def forget(self, pinned: PinnedPool) -> None:
        """Hand a written (or abandoned) sample's pinned blocks back and remove its spill file, once."""
        if self.chunks is not None:
            self.chunks = None
            pinned.release(self.blocks)
            if self.spill is not None:
                self.spill.close()


@dataclass(frozen=True, slots=True, eq=False)
class ShardPlan:
    """A shard's samples (in the driver's order), their sizes and loss masks, and how its states are stored."""
    sample_ids: list[str]
    num_tokens: dict[str, int]
    loss_masks: dict[str, list[int]]
    codec: Codec


@dataclass(frozen=True, slots=True, eq=False)
class OpenShard:
    """A shard between its begin and end markers."""
    plan: ShardPlan
    future: Future | None  # its writer's (digest, bytes); None on ranks that do not write


@dataclass(frozen=True, slots=True, eq=False)
class EndedShard:
    """A shard whose samples were all captured, until the driver's poll reports it."""
    samples: dict[str, tuple[int, int]]  # sample id -> (tokens, crc32 of the token ids)
    future: Future | None
