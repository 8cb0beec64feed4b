"""The prepared table (`samples.parquet` and the files beside it): what preparation writes and extraction reads,
and the rules every extraction input row must meet (checked before any model is loaded)."""

from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from eagle_states.dataset.files import atomic_write_bytes, sha256_file
from eagle_states.dataset.layout import check_sample_id

SAMPLES_FILE = "samples.parquet"
TOKEN_FREQ_FILE = "token_freq.json"
SKIPPED_FILE = "skipped.jsonl"
REPORT_FILE = "report.json"
SAMPLE_COLUMNS = ["sample_id", "source_row", "input_ids", "loss_mask", "num_tokens", "num_loss_tokens"]


class InputError(ValueError):
    """A row of the extraction input breaks the rules (deterministic: never retried)."""


@dataclass
class InputSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    source_row: int

    @functools.cached_property
    def digest(self) -> bytes:
        """sha256 of the sample's id, tokens, mask and source row (the input and shard content hashes use it)."""
        h = hashlib.sha256(json.dumps([self.sample_id, self.source_row]).encode())
        h.update(np.asarray(self.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(self.loss_mask, dtype=np.uint8).tobytes())
        return h.digest()


def input_hash(samples: Iterable[InputSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.digest)
    return h.hexdigest()


def write_samples(out_dir: Path, samples: list[dict]) -> None:
    """`samples`: dicts with SAMPLE_COLUMNS, in order."""
    import pandas as pd

    frame = pd.DataFrame(samples, columns=SAMPLE_COLUMNS)
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    atomic_write_bytes(Path(out_dir) / SAMPLES_FILE, buffer.getvalue())


def finished_report(out_dir: Path, identity: str) -> dict | None:
    """The report of the prepared layout in `out_dir` if it is there, was made under `identity` (what made it:
    data, model, settings, code) and its samples file is the one it describes; else None."""
    out_dir = Path(out_dir)
    try:
        report = json.loads((out_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if report.get("identity") != identity or not (out_dir / SAMPLES_FILE).exists():
        return None
    if report.get("samples_sha256") != sha256_file(out_dir / SAMPLES_FILE):
        return None
    return report


def prepared_input_hash(path: Path) -> str | None:
    """`input_hash` of an extraction input (a prepared directory or a JSONL of token ids) as a manifest records it
    (`input_sha256`), without the row checks; None where there is no such input (any more)."""
    try:
        rows, _ = _rows(Path(path))
        return input_hash(InputSample(str(r.get("id", r.get("sample_id"))), r["input_ids"], r.get("loss_mask"),
                                      int(r.get("source_row", 0))) for r in rows)
    except (OSError, InputError, KeyError, TypeError, ValueError):
        return None


def read_sample_ids(prepared_dir: Path) -> list[str]:
    import pandas as pd

    return list(pd.read_parquet(Path(prepared_dir) / SAMPLES_FILE, columns=["sample_id"])["sample_id"])


def check_row(row: dict, where: str, vocab_size: int, max_tokens: int, min_loss_tokens: int = 0) -> InputSample:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with id, input_ids, loss_mask")
    if "id" not in row and "sample_id" not in row:
        raise InputError(f"{where}: no 'id'")
    sample_id = str(row.get("id", row.get("sample_id")))
    try:
        check_sample_id(sample_id)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    # checked with whole-list operations (set of types, min, max): a run reads millions of token ids
    ids = row.get("input_ids")
    if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int}:
        raise InputError(f"{where} (id {sample_id}): 'input_ids' must be a non-empty list of integers")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise InputError(f"{where} (id {sample_id}): token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}")
    if len(ids) > max_tokens:
        raise InputError(f"{where} (id {sample_id}): {len(ids)} tokens, the engine takes at most {max_tokens}")
    mask = row.get("loss_mask", [1] * len(ids))
    if (not isinstance(mask, list) or len(mask) != len(ids) or not set(map(type, mask)) <= {int}
            or not set(mask) <= {0, 1}):
        raise InputError(f"{where} (id {sample_id}): 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})")
    if sum(mask) < min_loss_tokens:
        raise InputError(f"{where} (id {sample_id}): {sum(mask)} loss tokens; validation needs at least "
                         f"{min_loss_tokens} (validate.min_loss_tokens)")
    return InputSample(sample_id, ids, mask, int(row.get("source_row", 0)))


def _rows(path: Path) -> tuple[Iterator[dict], str]:
    """(rows, how a row is named in errors) from a prepared directory or a JSONL of {id, input_ids, loss_mask}."""
    if path.is_dir():
        import pandas as pd

        table = path / SAMPLES_FILE
        if not table.exists():
            raise InputError(f"{path}: a directory without {SAMPLES_FILE} (run `eagle-states prepare`)")
        frame = pd.read_parquet(table, columns=["sample_id", "input_ids", "loss_mask", "source_row"])
        return ({"id": r.sample_id, "input_ids": r.input_ids.tolist(), "loss_mask": r.loss_mask.tolist(),
                 "source_row": int(r.source_row)} for r in frame.itertuples(index=False)), f"{table} sample"

    def parse(lines):
        for n, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    row = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise InputError(f"{path} line {n}: not UTF-8 text (byte {exc.start}: {exc.reason}); expected "
                                     "JSON lines of {id, input_ids, loss_mask}") from None
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path} line {n}: not JSON ({exc.msg})") from None
                if isinstance(row, dict):
                    row.setdefault("source_row", n)
                yield row
    return parse(path.open("rb")), f"{path} line"


def load_input(path: Path, vocab_size: int, max_tokens: int, min_loss_tokens: int = 0) -> list[InputSample]:
    """Every row of the extraction input, checked. Any bad row stops the run with an error naming the row:
    extraction input is meant to be prepared already, and silently dropping a row would make the dataset
    disagree with its input."""
    path = Path(path)
    rows, where = _rows(path)
    samples, seen = [], {}
    for n, row in enumerate(rows, start=1):
        label = f"{where} {row.get('source_row', n) if isinstance(row, dict) else n}"
        sample = check_row(row, label, vocab_size, max_tokens, min_loss_tokens)
        if sample.sample_id in seen:
            raise InputError(f"{label}: sample id {sample.sample_id} already used by row {seen[sample.sample_id]}")
        seen[sample.sample_id] = sample.source_row
        samples.append(sample)
    if not samples:
        raise InputError(f"{path}: no samples")
    return samples
