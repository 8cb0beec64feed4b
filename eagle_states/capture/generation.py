"""Generation through the capture engine (the regenerate step): requests taken as room frees up, their stop tokens
found here, and the requests flagged to capture captured while they generate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from eagle_states.capture import protocol as p
from eagle_states.capture.protocol import GENERATING_KEY, SAMPLE_ID_KEY, CaptureError
from eagle_states.capture.worker_calls import CaptureWorkers, ShardJob, ShardResult

if TYPE_CHECKING:
    from eagle_states.capture.engine import CaptureEngine


@dataclass(frozen=True, eq=False)
class Generation:
    """A request to generate: the prompt's token ids, at most `max_new_tokens` tokens, ended by any of `stop_ids`
    (kept as the last token). `capture`: the states are captured while it generates (prompt and generated tokens)."""
    key: str  # unique among the requests of one `generate` call
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # the request's own generator: the draws do not depend on the batch
    capture: bool = False


@dataclass(frozen=True)
class Generated:
    key: str
    prompt_ids: list[int]
    token_ids: list[int]  # what it generated; ends with the stop token when `stopped`
    stopped: bool  # False: cut at max_new_tokens


@dataclass
class FollowUp:
    """What the caller of `generate` does after a generation: more requests (queued before those not yet
    added), the sample id that a captured generation's states are kept as (None: they are dropped), and shards of
    captured samples to write."""
    requests: list[Generation] = field(default_factory=list)
    keep_capture_as: str | None = None
    shards: list[ShardJob] = field(default_factory=list)


class _Running:
    """A generation in the engine: where its tokens have been looked at for a stop token."""

    __slots__ = ("request", "scanned", "stop_at")

    def __init__(self, request: Generation):
        self.request, self.scanned, self.stop_at = request, 0, None

    def ended(self, tokens: list[int]) -> Generated | None:
        """The generation's result once decided. A captured one runs one step past its last token: that step feeds
        the last token, whose row the sample needs (a generation never feeds its own last token otherwise)."""
        request = self.request
        extra = int(request.capture)
        limit = min(len(tokens), request.max_new_tokens)
        while self.stop_at is None and self.scanned < limit:
            if tokens[self.scanned] in request.stop_ids:
                self.stop_at = self.scanned
            self.scanned += 1
        if self.stop_at is not None:
            end, stopped = self.stop_at + 1, True
        elif len(tokens) >= request.max_new_tokens:
            end, stopped = request.max_new_tokens, False
        else:
            return None
        if len(tokens) < end + extra:
            return None
        return Generated(request.key, request.prompt_ids, list(tokens[:end]), stopped)


def _generation_params(request: Generation, request_id: str):
    from vllm import SamplingParams

    # the worker keeps a captured generation's rows under its request id (unique for the engine's life) until
    # `FinishGeneration` names its sample
    extra = {SAMPLE_ID_KEY: request_id, GENERATING_KEY: True} if request.capture else None
    return SamplingParams(max_tokens=request.max_new_tokens + int(request.capture),
                          temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                          ignore_eos=True, detokenize=False, extra_args=extra)


def generate(engine: CaptureEngine, requests: Iterable[Generation],
             on_generated: Callable[[Generated | None], FollowUp]) -> Iterator[ShardResult]:
    """Generate `requests` (taken as room frees up) and what `on_generated` asks for after each result; yields
    the shards of captured samples once their files are on disk. `on_generated(None)` is called once nothing
    is left to generate (for the last shards). Stop tokens are found here, not by vLLM (`ignore_eos`), so that
    a captured generation can run the one step more that its last token's row needs; the others are aborted at
    their stop token.

    Requests are added at points fixed by the results before them (vLLM's engine core runs in this process),
    so the same requests give the same batches, and with seeded requests the same tokens and bytes."""
    source, queued = iter(requests), deque()
    running: dict[str, _Running] = {}
    room = 2 * engine.settings.max_num_seqs  # enough waiting that a freed sequence slot is filled at once
    try:
        while True:
            while len(running) < room:
                request = queued.popleft() if queued else next(source, None)
                if request is None:
                    break
                request_id = engine.request_id("generate", request.key)
                engine.llm.llm_engine.add_request(request_id, {"prompt_token_ids": request.prompt_ids},
                                              _generation_params(request, request_id))
                running[request_id] = _Running(request)
            if not running:
                _follow(engine.workers, on_generated(None), queued)
                if not queued:
                    break
                continue
            for output in engine.llm.llm_engine.step():
                state = running.get(output.request_id)
                if state is None:
                    continue
                result = state.ended(output.outputs[0].token_ids)
                if result is None:
                    if output.finished:
                        raise CaptureError(f"generation {state.request.key}: vLLM ended it "
                                           f"({output.outputs[0].finish_reason}) before its end was reached")
                    continue
                del running[output.request_id]
                if not output.finished:
                    engine.llm.llm_engine.abort_request([output.request_id])
                _follow(engine.workers, on_generated(result), queued, output.request_id, state.request, result)
            yield from engine.workers.collect(wait=False)
        yield from engine.workers.collect(wait=True)
    except BaseException:
        engine.reset(list(running))
        raise


def _follow(workers: CaptureWorkers, follow: FollowUp, queued: deque, request_id: str | None = None,
            request: Generation | None = None, result: Generated | None = None) -> None:
    if request is not None and request.capture:
        workers.call(p.FinishGeneration(key=request_id, sample_id=follow.keep_capture_as,
                                        num_tokens=len(result.prompt_ids) + len(result.token_ids)))
    queued.extend(follow.requests)
    for job in follow.shards:  # its samples are captured already: the writer takes them at once
        workers.begin_shard(job)
        workers.call(p.EndShard(path=str(job.path)))
