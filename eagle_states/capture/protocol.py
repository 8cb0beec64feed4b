"""The calls between the engine driver and the capture worker, defined once: each call is a typed message sent
through vLLM's `collective_rpc` to one entry point (`ENTRY_POINT`), answered by every worker rank with an
`Envelope` whose payload has the type `REPLY[type(call)]`. The driver builds calls (checked as they are made),
the worker dispatches on their type and builds replies (checked likewise), and `check_replies` checks what came
back before anything trusts it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from eagle_states.dataset.codec import Codec

ENTRY_POINT = "eagle_capture_call"  # the worker extension's one method the driver calls
SAMPLE_ID_KEY = "eagle_states_sample_id"  # SamplingParams.extra_args key: the request's sample


class CaptureError(RuntimeError):
    pass


class UnsupportedModelError(CaptureError):
    pass


class UnsupportedRunnerError(UnsupportedModelError):
    """The engine runs a model runner the capture hooks were not written for (vLLM's V2 runner, or a vLLM without
    the V1 runner)."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- calls -----------------------------------------------------------------------------------------------------
class Setup(Message):
    """Install the hooks. `num_layers` and `hidden_size` are what config.json says: the live model must agree."""
    layer_ids: list[int]
    num_layers: int
    hidden_size: int
    write_threads: int


class BeginShard(Message):
    """A shard's plan, queued before its requests run: its file is written sample by sample as they complete."""
    path: str
    sample_ids: list[str]
    num_tokens: list[int]
    loss_masks: list[list[int]]
    codec: Codec = Codec()  # how its hidden states are stored (default: plain tensors)


class EndShard(Message):
    """The end of a shard, queued behind the steps already captured."""
    path: str


class Poll(Message):
    """Shards done since the last poll; `wait` blocks until every ended shard is done."""
    wait: bool


class Stats(Message):
    """The writer rank's counters; the forward clock's next gap is counted from the next pass on."""


class Discard(Message):
    """After a failure: forget partial samples and unfinished shards (their temp files go) so a retry starts clean."""


# -- replies ---------------------------------------------------------------------------------------------------
class SetupReply(Message):
    num_layers: int
    hidden_size: int
    device: str
    vllm_version: str
    model_runner: str  # its module and class: the V1 runner (`worker.check_model_runner`)
    kv_cache_blocks: int
    kv_cache_groups: int
    kv_block_tokens: int


class Queued(Message):
    path: str


class ShardReport(Message):
    """What a rank captured of a shard: sample id -> (tokens, crc32 of the int32 token ids); the writer rank
    adds the file's sha256 and size."""
    samples: dict[str, tuple[int, int]]
    sha256: str | None = None
    bytes: int | None = None


class PollReply(Message):
    shards: dict[str, ShardReport]
    launched: list[str]  # samples whose last prompt rows were launched since the last poll


class StatsReply(Message):
    steps: int
    rows: int
    decode_rows_dropped: int
    pinned_wait_s: float  # the forward pass blocked on host buffers (back-pressure from writing)
    last_hand_off: float  # time.monotonic() of the last captured step
    forwards: int
    forward_s: float  # device time in forward passes
    between_forwards_s: float  # device idle between them
    encoded_bytes: int  # hidden-state bytes compressed by the shard writers (extract.codec)
    encode_s: float  # the writer threads' time in compressing them (summed over threads)


class Discarded(Message):
    samples: list[str]


REPLY: dict[type[Message], type[Message]] = {Setup: SetupReply, BeginShard: Queued, EndShard: Queued,
                                             Poll: PollReply, Stats: StatsReply, Discard: Discarded}


class Envelope(Message):
    rank: int
    world_size: int
    writer: bool  # tensor-parallel rank 0 writes the files; every rank reports what it captured
    payload: Message


def check_replies(replies, call: Message, world_size: int) -> list[Envelope]:
    """Check a `collective_rpc` result: one envelope per rank, ranks 0..world_size-1, exactly one writer, every
    payload of the call's reply type. Indexing the result blindly is how a single layer's tensor once passed
    for the list of all layers."""
    name = type(call).__name__
    if not isinstance(replies, list):
        raise CaptureError(f"{name}: expected a list of {world_size} replies, got {type(replies).__name__}")
    if len(replies) != world_size:
        raise CaptureError(f"{name}: {len(replies)} replies for {world_size} ranks")
    want = REPLY[type(call)]
    for i, reply in enumerate(replies):
        if not isinstance(reply, Envelope):
            raise CaptureError(f"{name}: reply {i} is a {type(reply).__name__}, expected an Envelope")
        if reply.world_size != world_size:
            raise CaptureError(f"{name}: reply {i} reports world size {reply.world_size}, expected {world_size}")
        if not isinstance(reply.payload, want):
            raise CaptureError(f"{name}: reply {i} carries a {type(reply.payload).__name__}, expected {want.__name__}")
    ranks = sorted(r.rank for r in replies)
    if ranks != list(range(world_size)):
        raise CaptureError(f"{name}: replies from ranks {ranks}, expected 0..{world_size - 1}")
    writers = [r for r in replies if r.writer]
    if len(writers) != 1:
        raise CaptureError(f"{name}: {len(writers)} ranks claim to write, expected exactly one")
    return replies


def writer_payload(replies: list[Envelope]):
    return next(r.payload for r in replies if r.writer)


def check_shard_agreement(reports: dict[int, ShardReport], world_size: int, shard: str) -> ShardReport:
    """Every rank must report the same samples (token counts and id checksums) for a shard; returns the writer's
    report. `reports` maps rank -> that rank's report of the shard."""
    if sorted(reports) != list(range(world_size)):
        raise CaptureError(f"shard {shard}: reports from ranks {sorted(reports)}, expected 0..{world_size - 1}")
    writer = [r for r, rep in reports.items() if rep.sha256 is not None]
    if len(writer) != 1:
        raise CaptureError(f"shard {shard}: {len(writer)} ranks report a written file, expected exactly one")
    expected = reports[writer[0]].samples
    for rank, report in reports.items():
        if report.samples != expected:
            raise CaptureError(f"shard {shard}: rank {rank} captured different samples or lengths than the "
                               f"writer rank {writer[0]}")
    return reports[writer[0]]
