"""Regeneration: every assistant turn of a conversation replaced, in order, by the target model's own reply to the
conversation so far (earlier turns already regenerated), rendered with its chat template and generation prompt, so
that a draft model learns what its target says rather than what another model once wrote.

Conversations are read and selected as `prepare` does (formats, bad rows, `limit`, `shuffle_seed`, `dedup`); a
conversation that ends with a user turn gets that turn answered; turns after the last assistant turn are left out.
The output directory has the prepared layout (samples.parquet, token_freq.json, skipped.jsonl, report.json),
whose token ids are the generated ones themselves (re-tokenizing the decoded text could give other ids than the
model produced), plus the regenerated conversations as text:

    conversations.jsonl   id, source_row, messages (OpenAI style), truncated_turns

A sample's `input_ids` are the last turn's prompt (the conversation before it, rendered with the generation prompt)
followed by the tokens generated for it (with the stop token when it stopped); its `loss_mask` marks exactly the
regenerated assistant tokens (the earlier ones as the template renders them in that prompt, and the generated
ones). Every input row is either written or listed in skipped.jsonl with its reason, as in `prepare`.

With `capture`, the last turn's generation captures the states as it runs (`CaptureEngine.generate`): the samples
are packed into shards in output order by the same rule as `plan_shards`, and each shard is written with its
receipt as soon as its samples are decided, so the extract step finds every shard finished and only finalizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from eagle_states.capture.engine import CaptureEngine, EngineSettings
from eagle_states.capture.generation import FollowUp, Generated, Generation
from eagle_states.capture.worker_calls import ShardJob
from eagle_states.config import PipelineParams, PrepareParams
from eagle_states.dataset.capture_format import UNCOMPRESSED_SAME_SINCE
from eagle_states.dataset.files import atomic_write_bytes, hash_files, hash_json, sha256_file
from eagle_states.dataset.identity import model_identity
from eagle_states.dataset.prepared import REPORT_FILE, InputSample
from eagle_states.dataset.prepared import finished_report as finished_prepared_report
from eagle_states.extraction.driver import CaptureConfig, PlannedShard, ShardPacker
from eagle_states.prepare import (NotAConversationDataset, SkipRow, dedup_key, detect_format, load_tokenizer,
                                  parse_row, read_rows, renderer, sample_id_for, write_prepared)

log = logging.getLogger(__name__)
CONVERSATIONS_FILE = "conversations.jsonl"
DISABLED_REPORT = {"enabled": False}  # what the step writes when it is off (DVC's output must exist)


def stop_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The tokens that end a reply, as vLLM takes them: the tokenizer's EOS and generation_config.json's."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_path = Path(model_dir) / "generation_config.json"
    if config_path.exists():
        eos = json.loads(config_path.read_text()).get("eos_token_id")
        stops.update([eos] if isinstance(eos, int) else eos or [])
    if not stops:
        raise ValueError(f"{model_dir}: neither the tokenizer nor generation_config.json names an end-of-turn token")
    return frozenset(stops)


@dataclass
class _Conversation:
    order: int  # among the selected conversations: the output's order
    source_row: int
    messages: list[dict]  # cut after its last assistant turn; assistant contents replaced as they are generated
    turns: list[int]  # positions of the assistant turns, in order
    seed_key: str  # the source conversation's content: seeds its turns independently of the batch
    turn: int = 0  # the turn being generated
    prompt_mask: list[int] = field(default_factory=list)
    truncated: int = 0


@dataclass
class RegenerationResult:
    samples: list[dict]
    skipped: list[dict]
    conversations: list[dict]  # the rows of conversations.jsonl
    rows_read: int
    format: str
    mask_method: str
    turns: int = 0
    generated_tokens: int = 0
    truncated_turns: int = 0
    shards: list[str] = field(default_factory=list)  # written while generating (capture)


class Regeneration:
    """The conversations of one input and the state of their regeneration: `requests()` and `on_generated` are
    what `CaptureEngine.generate` takes. With `capture` (a `CaptureConfig`), the last turns are captured and the
    decided samples are handed back as shards (`FollowUp.shards`) in output order; `on_shard` hears of each."""

    def __init__(self, params: PipelineParams, tokenizer, rows: list[tuple[int, object]],
                 capture: CaptureConfig | None = None):
        self.params = params
        self.tokenizer, self.capture = tokenizer, capture
        self.render, self.mask_method = renderer(tokenizer)
        self.template_key = model_identity(Path(params.model.path))["tokenizer_sha256"]
        self.stop_ids = stop_token_ids(Path(params.model.path), tokenizer)
        self.rows_read = len(rows)
        parsed = [r for _, r in rows if not isinstance(r, SkipRow)]
        self.format = params.data.format if params.data.format != "auto" else detect_format(parsed)
        self.skipped: list[dict] = []
        self.selected: list[_Conversation] = []
        self._select(rows, params.prepare)
        self.decided: dict[int, dict | None] = {}  # order -> sample, or None when skipped
        self.next_out = 0  # the first order not yet handed to the output
        self.samples: list[dict] = []
        self.conversations: list[dict] = []
        self.ids_seen: Counter = Counter()
        self.packer = ShardPacker(params.extract.shard_max_tokens) if capture else None
        self.planned: dict[str, PlannedShard] = {}  # shards handed to the engine, until written
        self.turns = self.generated_tokens = self.truncated_turns = 0

    # -- selection, as prepare selects --------------------------------------------------------------------------
    def _select(self, rows, prepare_params: PrepareParams) -> None:
        order = list(range(len(rows)))
        if prepare_params.shuffle_seed is not None:
            random.Random(prepare_params.shuffle_seed).shuffle(order)
        seen: Counter = Counter()
        for position in order:
            source_row, row = rows[position]
            if prepare_params.limit is not None and len(self.selected) >= prepare_params.limit:
                self._skip(source_row, "over_limit", f"limit {prepare_params.limit}")
                continue
            try:
                messages = parse_row(row, self.format, require_assistant=False)
                if isinstance(messages, str):
                    raise SkipRow("plain_text", "a text row has no turn to answer")
                key = dedup_key(messages)
                if seen[key] and prepare_params.dedup:
                    raise SkipRow("duplicate", "an identical conversation came earlier")
                seen[key] += 1
                if messages[-1]["role"] == "user":  # a prompt waiting for its answer
                    messages = messages + [{"role": "assistant", "content": ""}]
                turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
                if not turns:
                    raise SkipRow("no_turn_to_answer", f"{len(messages)} turns, no assistant or final user turn")
                self.selected.append(_Conversation(len(self.selected), source_row, messages[: turns[-1] + 1],
                                                   turns, f"{seen[key]}:{key}"))
            except SkipRow as exc:
                self._skip(source_row, exc.reason, exc.detail)

    def _skip(self, source_row: int, reason: str, detail: str = "") -> None:
        self.skipped.append({"source_row": source_row, "reason": reason, "detail": detail})

    # -- generation ---------------------------------------------------------------------------------------------
    def requests(self) -> Iterator[Generation]:
        """Every conversation's first turn, rendered as it is taken."""
        for conversation in self.selected:
            request = self._request(conversation)
            if request is not None:
                yield request

    def _request(self, conversation: _Conversation) -> Generation | None:
        """The request for the conversation's current turn, or None when it cannot be asked (the conversation is
        then skipped)."""
        r = self.params.regenerate
        position = conversation.turns[conversation.turn]
        try:
            prompt_ids, conversation.prompt_mask = self.render(self.tokenizer, conversation.messages[:position],
                                                               generation_prompt=True)
        except SkipRow as exc:
            self._decide(conversation, skip=(exc.reason, exc.detail))
            return None
        room = self.params.prepare.max_length - len(prompt_ids)
        if room < 1:
            self._decide(conversation, skip=("context_too_long", f"turn {conversation.turn}: {len(prompt_ids)} "
                                             f"prompt tokens, prepare.max_length {self.params.prepare.max_length}"))
            return None
        seed = int.from_bytes(hashlib.sha256(f"{r.seed}:{conversation.turn}:{conversation.seed_key}".encode())
                              .digest()[:4], "big") >> 1
        last = conversation.turn == len(conversation.turns) - 1
        return Generation(key=f"{conversation.order}:{conversation.turn}", prompt_ids=prompt_ids,
                          max_new_tokens=min(r.max_new_tokens, room), stop_ids=self.stop_ids,
                          temperature=r.temperature, top_p=r.top_p, seed=seed,
                          capture=last and self.capture is not None)

    def on_generated(self, result: Generated | None) -> FollowUp:
        if result is None:  # nothing left to generate: the last shard closes
            return FollowUp(shards=self._flush(final=True))
        order, turn = map(int, result.key.split(":"))
        conversation = self.selected[order]
        self.turns += 1
        self.generated_tokens += len(result.token_ids)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        conversation.messages[conversation.turns[turn]] = {"role": "assistant", "content": text}
        if not result.stopped:
            self.truncated_turns += 1
            conversation.truncated += 1
            if self.params.regenerate.on_truncated == "drop":
                self._decide(conversation, skip=("truncated_turn", f"turn {turn}: {len(result.token_ids)} tokens, "
                                                 "no end-of-turn token"))
                return FollowUp(shards=self._flush())
        if turn + 1 < len(conversation.turns):
            conversation.turn += 1
            request = self._request(conversation)
            return FollowUp(requests=[request] if request else [], shards=self._flush())
        input_ids = result.prompt_ids + result.token_ids
        loss_mask = conversation.prompt_mask + [1] * len(result.token_ids)
        if sum(loss_mask) < self.params.prepare.min_loss_tokens:
            self._decide(conversation, skip=("too_few_loss_tokens", f"{sum(loss_mask)} loss tokens < "
                                             f"{self.params.prepare.min_loss_tokens}"))
            return FollowUp(shards=self._flush())
        key = dedup_key(conversation.messages)
        sample_id = sample_id_for(conversation.messages, self.template_key, self.ids_seen[key])
        self.ids_seen[key] += 1
        self._decide(conversation, sample={
            "sample_id": sample_id, "source_row": conversation.source_row, "input_ids": input_ids,
            "loss_mask": loss_mask, "num_tokens": len(input_ids), "num_loss_tokens": sum(loss_mask)})
        return FollowUp(keep_capture_as=sample_id if self.capture else None, shards=self._flush())

    def _decide(self, conversation: _Conversation, sample: dict | None = None, skip: tuple[str, str] = None):
        if skip is not None:
            self._skip(conversation.source_row, *skip)
        self.decided[conversation.order] = sample

    def _flush(self, final: bool = False) -> list[ShardJob]:
        """Hands the decided samples to the output in order; returns the jobs of the shards they close (capture),
        whose plans wait in `planned` until their files are written."""
        shards = []
        while self.next_out in self.decided:
            sample = self.decided.pop(self.next_out)
            conversation = self.selected[self.next_out]
            self.next_out += 1
            if sample is None:
                continue
            self.samples.append(sample)
            self.conversations.append({"id": sample["sample_id"], "source_row": sample["source_row"],
                                       "messages": conversation.messages, "truncated_turns": conversation.truncated})
            if self.packer is not None:
                closed = self.packer.add(InputSample(sample["sample_id"], sample["input_ids"], sample["loss_mask"],
                                                     sample["source_row"]))
                shards += [closed] if closed else []
        if final:
            if self.next_out != len(self.selected):
                raise RuntimeError(f"regeneration ended with {len(self.selected) - self.next_out} conversations "
                                   "undecided")
            closed = self.packer.close() if self.packer is not None else None
            shards += [closed] if closed else []
        self.planned.update((shard.name, shard) for shard in shards)
        return [self.capture.job(shard) for shard in shards]

    def result(self) -> RegenerationResult:
        return RegenerationResult(self.samples, sorted(self.skipped, key=lambda s: s["source_row"]),
                                  self.conversations, self.rows_read, self.format, self.mask_method, self.turns,
                                  self.generated_tokens, self.truncated_turns)


# ---------------------------------------------------------------------------------------------------------------
def regenerate(params: PipelineParams, get_engine: Callable[[EngineSettings], CaptureEngine], *,
               identity: str, progress: bool = False,
               on_progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Regenerate `data.path` into `regenerate.out` on the engine `get_engine` gives (loaded only if some
    conversation is to be generated); with `regenerate.capture`, write the dataset's shards into `output.dir`
    as well. Returns the report (written last, with `identity`)."""
    from tqdm import tqdm

    started = time.time()
    out = Path(params.regenerate.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).unlink(missing_ok=True)  # the report marks a finished regeneration: drop it first
    tokenizer = load_tokenizer(Path(params.model.path))
    rows = list(read_rows(Path(params.data.path)))
    if not rows:
        raise NotAConversationDataset(f"{params.data.path}: no rows")
    config = CaptureConfig(params)
    regeneration = Regeneration(params, tokenizer, rows, capture=config if params.regenerate.capture else None)
    total = len(regeneration.selected)
    written: list[str] = []
    if total:
        engine = get_engine(config.engine_settings())
        with tqdm(total=total, unit="conv", desc="regenerate", disable=not progress) as bar:
            def on_generated(result: Generated | None) -> FollowUp:
                follow = regeneration.on_generated(result)
                bar.update(regeneration.next_out - bar.n)
                on_progress(regeneration.next_out, total)
                return follow
            for shard_result in engine.generate(regeneration.requests(), on_generated):
                config.write_receipt(regeneration.planned.pop(shard_result.name), shard_result)
                written.append(shard_result.name)
    result = regeneration.result()
    seconds = time.time() - started
    atomic_write_bytes(out / CONVERSATIONS_FILE, "".join(json.dumps(c, ensure_ascii=False) + "\n"
                                                         for c in result.conversations).encode())
    r = params.regenerate
    model = model_identity(Path(params.model.path))
    report = write_prepared(out, result.samples, result.skipped, len(tokenizer), {
        "enabled": True, "source": str(params.data.path), "format": result.format,
        "mask_method": result.mask_method, "rows_read": result.rows_read,
        "settings": {**r.model_dump(exclude={"out", "enabled"}),
                     **{f"prepare.{k}": v for k, v in params.prepare.model_dump(exclude={"out"}).items()}},
        "model": {k: v for k, v in model.items() if k != "path"}, "model_path": model["path"],
        "stop_token_ids": sorted(regeneration.stop_ids), "turns_generated": result.turns,
        "tokens_generated": result.generated_tokens, "truncated_turns": result.truncated_turns,
        "seconds": round(seconds, 3), "tokens_per_second": round(result.generated_tokens / seconds, 1),
        "shards_captured": written, "conversations_sha256": sha256_file(out / CONVERSATIONS_FILE),
        "identity": identity, "tokenizer_sha256": model["tokenizer_sha256"]})
    log.info("regenerated %d conversations (%d turns, %d tokens, %d truncated) in %.1f s; %d rows skipped",
             report["rows_written"], result.turns, result.generated_tokens, result.truncated_turns, seconds,
             report["rows_skipped"])
    return report


# Raise in the change that alters what a regeneration writes from the same inputs and settings (the prompts it
# renders, the tokens it keeps, the layout of its output).
REGENERATE_FORMAT_VERSION = 1


def identity(params: PipelineParams) -> str:
    """What decides the regenerated output: the data, the model (weights, tokenizer, end-of-turn tokens), the
    selection and regeneration settings, the engine settings that decide the batches (and so, to the last bit, the
    sampled tokens), the declared formats; with capture, everything that decides the shards too."""
    e = params.extract
    model = model_identity(Path(params.model.path))
    # declared, not the source text: an edit that changes no token must not cost a regeneration. Of the capture
    # format, what a regeneration shares with an uncompressed capture (its engine steps); a codec's layout is the
    # shards' alone, which `capture` covers
    code = {"regenerate_format": REGENERATE_FORMAT_VERSION, "capture_format": UNCOMPRESSED_SAME_SINCE}
    return hash_json({
        "data": sha256_file(Path(params.data.path)), "model": {k: v for k, v in model.items() if k != "path"},
        "end_of_turn": hash_files([Path(params.model.path) / "generation_config.json"]),  # its stop tokens
        "format": params.data.format, "prepare": params.prepare.model_dump(exclude={"out"}),
        "regenerate": params.regenerate.model_dump(exclude={"out"}),
        "engine": {"dtype": e.dtype, "max_num_batched_tokens": e.max_num_batched_tokens,
                   "max_num_seqs": e.max_num_seqs, "tensor_parallel_size": e.tensor_parallel_size},
        "code": code, "capture": CaptureConfig(params).config_hash if params.regenerate.capture else None})


def finished_report(params: PipelineParams) -> dict | None:
    """The regeneration report if `regenerate.out` was made from these inputs and is intact, else None."""
    return finished_prepared_report(Path(params.regenerate.out), identity(params))
