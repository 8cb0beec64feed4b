"""Prompt preparation: conversations become token ids and an assistant loss mask, through the target model's own
chat template and tokenizer. Every input row is either written or recorded in skipped.jsonl with its reason.

Output directory:
    samples.parquet   sample_id, source_row, input_ids, loss_mask, num_tokens, num_loss_tokens
    token_freq.json   counts of each token id over the loss tokens (for draft-vocabulary selection)
    skipped.jsonl     one row per skipped input row: source_row, reason, detail
    report.json       rows_read, rows_written, rows_skipped, skipped_by_reason, format, ... (written last)

`source_row` is 1-based: the line of a JSONL file, or the position in a JSON array.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eagle_states.config import PrepareParams
from eagle_states.dataset.files import atomic_write_bytes, atomic_write_json, sha256_file
from eagle_states.dataset.identity import model_identity
from eagle_states.dataset.prepared import (REPORT_FILE, SAMPLES_FILE, SKIPPED_FILE, TOKEN_FREQ_FILE, InputError,
                                         write_samples)

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}
MESSAGE_ROLES = {"user", "assistant", "system"}


class NotAConversationDataset(InputError):
    pass


class SkipRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------------------------------------------
# Reading: (source_row, parsed row or SkipRow)
def read_rows(path: Path) -> Iterator[tuple[int, object]]:
    path = Path(path)
    raw = path.read_bytes()
    head = raw.lstrip()[:1]
    if head == b"[":
        try:
            rows = json.loads(raw.decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError as exc:
            raise NotAConversationDataset(f"{path}: a JSON array that does not parse ({exc})") from None
        for i, row in enumerate(rows, start=1):
            yield i, row
        return
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield n, SkipRow("invalid_utf8", f"byte {exc.start}: {exc.reason}")
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as exc:
            yield n, SkipRow("malformed_json", exc.msg)


def _has_surrogates(obj) -> bool:
    if isinstance(obj, str):
        return any("\ud800" <= c <= "\udfff" for c in obj)
    if isinstance(obj, dict):
        return any(_has_surrogates(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_surrogates(v) for v in obj)
    return False


def detect_format(rows: list[object]) -> str:
    for row in rows:
        if isinstance(row, dict):
            if isinstance(row.get("conversations"), list):
                return "sharegpt"
            if isinstance(row.get("messages"), list):
                return "messages"
            if "prompt" in row or "text" in row:
                return "prompt"
    raise NotAConversationDataset(
        "no row has 'conversations' (ShareGPT), 'messages' (OpenAI style) or 'prompt'/'text': "
        "this is not a conversation dataset")


def to_messages(row, fmt: str, require_assistant: bool = True) -> list[dict] | str:
    """A row as [{role, content}] (or a plain string for `text` rows); raises SkipRow with the reason.
    `require_assistant=False` accepts conversations without an assistant turn (regeneration answers them)."""
    if not isinstance(row, dict):
        raise SkipRow("not_an_object", f"a {type(row).__name__}")
    if fmt == "prompt":
        if isinstance(row.get("text"), str) and "prompt" not in row:
            if not row["text"].strip():
                raise SkipRow("empty_content", "text")
            return row["text"]
        prompt = row.get("prompt")
        answer = next((row[k] for k in ("completion", "response", "output") if k in row), None)
        turns = [{"role": "user", "content": prompt}]
        if answer is not None:
            turns.append({"role": "assistant", "content": answer})
    else:
        key, role_key, content_key, roles = (("conversations", "from", "value", SHAREGPT_ROLES) if fmt == "sharegpt"
                                             else ("messages", "role", "content", {r: r for r in MESSAGE_ROLES}))
        turns_in = row.get(key)
        if not isinstance(turns_in, list):
            raise SkipRow("missing_turns", f"no '{key}' list")
        turns = []
        for i, turn in enumerate(turns_in):
            if not isinstance(turn, dict):
                raise SkipRow("malformed_turn", f"turn {i} is a {type(turn).__name__}")
            role = roles.get(turn.get(role_key))
            if role is None:
                raise SkipRow("unknown_role", f"turn {i}: {turn.get(role_key)!r}")
            turns.append({"role": role, "content": turn.get(content_key)})
    for i, turn in enumerate(turns):
        if not isinstance(turn["content"], str):
            raise SkipRow("non_string_content", f"turn {i} ({turn['role']}): {type(turn['content']).__name__}")
        if not turn["content"].strip():
            raise SkipRow("empty_content", f"turn {i} ({turn['role']})")
    if require_assistant and not any(t["role"] == "assistant" for t in turns):
        raise SkipRow("no_assistant_turn", f"{len(turns)} turns, none from the assistant")
    return turns


# ---------------------------------------------------------------------------------------------------------------
# Rendering
def template_has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def render_with_markers(tokenizer, messages: list[dict], generation_prompt: bool = False
                        ) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        add_generation_prompt=generation_prompt)
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def render_by_prefix_diff(tokenizer, messages: list[dict], generation_prompt: bool = False
                          ) -> tuple[list[int], list[int]]:
    """For templates without {% generation %}: the text each assistant turn adds to the rendering of the
    conversation before it (with the generation prompt) is that turn; its tokens are found by character offsets
    (comparing token ids would misplace the boundary where BPE merges differ at the end of a string).
    `generation_prompt`: the rendering ends with the assistant's generation prompt (a prompt to answer)."""
    def text(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = text(messages, generation_prompt)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = text(messages[: i + 1], False)
        if i:
            before = text(messages[:i], True)
            start = len(before) if through.startswith(before) else -1
        else:  # templates refuse an empty conversation: find the generation prompt in the first turn instead
            probe = [{"role": "user", "content": "x"}]
            generation_prompt = text(probe, True)[len(text(probe, False)):]
            start = through.find(generation_prompt) + len(generation_prompt) if generation_prompt in through else -1
        if start < 0 or not full.startswith(through):
            raise SkipRow("template_not_prefix_stable", f"rendering turn {i} changes the text before it")
        spans.append((start, len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start and end <= b and end > start for a, b in spans))
            for start, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def renderer(tokenizer):
    """The loss-mask rendering this tokenizer's chat template allows, and its name."""
    if template_has_generation_markers(tokenizer):
        return render_with_markers, "generation_markers"
    return render_by_prefix_diff, "prefix_diff"


def parse_row(row, fmt: str, require_assistant: bool = True) -> list[dict] | str:
    """A read row (or the SkipRow its reading raised) as messages; raises SkipRow with the reason."""
    if isinstance(row, SkipRow):
        raise row
    if _has_surrogates(row):
        raise SkipRow("invalid_utf8", "the row holds bytes that are not UTF-8")
    return to_messages(row, fmt, require_assistant)


def dedup_key(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def render_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids), [1] * len(ids)


def sample_id_for(messages, template_key: str, occurrence: int = 0) -> str:
    digest = hashlib.sha256(json.dumps([messages, template_key], sort_keys=True, ensure_ascii=False).encode())
    base = digest.hexdigest()[:20]
    return base if occurrence == 0 else f"{base}-{occurrence}"


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class PrepareResult:
    samples: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    rows_read: int = 0
    format: str = ""
    mask_method: str = ""


def prepare_rows(rows: list[tuple[int, object]], tokenizer, prepare_params: PrepareParams, fmt: str,
                 template_key: str, progress: bool = False) -> PrepareResult:
    from tqdm import tqdm

    result = PrepareResult(rows_read=len(rows))
    parsed = [r for _, r in rows if not isinstance(r, SkipRow)]
    result.format = fmt if fmt != "auto" else detect_format(parsed)
    render, result.mask_method = renderer(tokenizer)
    order = list(range(len(rows)))
    if prepare_params.shuffle_seed is not None:
        random.Random(prepare_params.shuffle_seed).shuffle(order)
    seen: Counter = Counter()

    def skip(source_row, reason, detail=""):
        result.skipped.append({"source_row": source_row, "reason": reason, "detail": detail})

    for position in tqdm(order, desc="prepare", unit="row", disable=not progress):
        source_row, row = rows[position]
        if prepare_params.limit is not None and len(result.samples) >= prepare_params.limit:
            skip(source_row, "over_limit", f"limit {prepare_params.limit}")
            continue
        try:
            messages = parse_row(row, result.format)
            key = dedup_key(messages)
            if seen[key] and prepare_params.dedup:
                raise SkipRow("duplicate", "an identical conversation came earlier")
            occurrence = seen[key]
            if isinstance(messages, str):
                ids, mask = render_text(tokenizer, messages)
            else:
                ids, mask = render(tokenizer, messages)
            if len(ids) > prepare_params.max_length:
                if prepare_params.overlong == "drop":
                    raise SkipRow("too_long", f"{len(ids)} tokens > max_length {prepare_params.max_length}")
                ids, mask = ids[: prepare_params.max_length], mask[: prepare_params.max_length]
            if sum(mask) < prepare_params.min_loss_tokens:
                raise SkipRow("too_few_loss_tokens", f"{sum(mask)} loss tokens < {prepare_params.min_loss_tokens}")
            seen[key] += 1
            result.samples.append({
                "sample_id": sample_id_for(messages, template_key, occurrence), "source_row": source_row,
                "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids), "num_loss_tokens": sum(mask)})
        except SkipRow as exc:
            skip(source_row, exc.reason, exc.detail)
    result.skipped.sort(key=lambda s: s["source_row"])
    return result


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not tokenizer.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    return tokenizer


def prepare(data_path: Path, model_dir: Path, out_dir: Path, prepare_params: PrepareParams, *, fmt: str,
            progress: bool = True, identity: str | None = None) -> dict:
    """Prepare `data_path` into `out_dir`; returns the report (written last, with `identity`, what the caller
    uses to recognise output made from the same inputs, and the sha256 of samples.parquet)."""
    rows = list(read_rows(data_path))  # before the tokenizer loads: a file that is not data fails in a second
    if not rows:
        raise NotAConversationDataset(f"{data_path}: no rows")
    tokenizer = load_tokenizer(model_dir)
    template_key = model_identity(model_dir)["tokenizer_sha256"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REPORT_FILE).unlink(missing_ok=True)  # the report marks a finished preparation: drop it first
    result = prepare_rows(rows, tokenizer, prepare_params, fmt, template_key, progress)
    log.info("prepare: %s format, masks from %s", result.format, result.mask_method)

    report = write_prepared(out_dir, result.samples, result.skipped, len(tokenizer), {
        "source": str(data_path), "data_sha256": sha256_file(data_path), "format": result.format,
        "mask_method": result.mask_method,
        "rows_read": result.rows_read, "settings": {**prepare_params.model_dump(exclude={"out"}), "format": fmt},
        "tokenizer_sha256": template_key, "identity": identity})
    return report


def write_prepared(out_dir: Path, samples: list[dict], skipped: list[dict], vocab_size: int, report: dict) -> dict:
    """The prepared layout (samples, token frequencies, skipped rows, then the report, last) from `samples`
    (SAMPLE_COLUMNS) and `skipped` ({source_row, reason, detail}); `report` holds `rows_read` and what describes
    the step. Refuses to write a report whose rows do not add up."""
    write_samples(out_dir, samples)
    freq = Counter()
    for s in samples:
        freq.update(t for t, m in zip(s["input_ids"], s["loss_mask"]) if m)
    atomic_write_json(out_dir / TOKEN_FREQ_FILE, {
        "vocab_size": vocab_size, "total": sum(freq.values()),
        "counts": {str(t): c for t, c in sorted(freq.items())}})
    atomic_write_bytes(out_dir / SKIPPED_FILE, "".join(json.dumps(s) + "\n" for s in skipped).encode())
    report = {**report, "rows_written": len(samples), "rows_skipped": len(skipped),
              "skipped_by_reason": dict(sorted(Counter(s["reason"] for s in skipped).items())),
              "num_tokens": sum(s["num_tokens"] for s in samples),
              "num_loss_tokens": sum(s["num_loss_tokens"] for s in samples),
              "samples_sha256": sha256_file(out_dir / SAMPLES_FILE)}
    if report["rows_read"] != report["rows_written"] + report["rows_skipped"]:
        raise RuntimeError(f"{out_dir}: rows lost: {report}")
    atomic_write_json(out_dir / REPORT_FILE, report)
    return report
