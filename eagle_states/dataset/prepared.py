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


@dataclass(eq=False)
class InputSample:
    """One extraction input row. Its token ids and mask are held as arrays (int32, uint8), not lists of Python
    ints: a billion-token input takes 5 GB of host memory in the process that plans it (and in each engine
    worker's), where lists took over 40 GB. The engine gets its ids as a list when the request is added."""
    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    source_row: int

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @functools.cached_property
    def digest(self) -> bytes:
        """sha256 of the sample's id, tokens, mask and source row (the input and shard content hashes use it).
        The ids are hashed as int64, as they were when samples were lists: finished shards keep their keys."""
        h = hashlib.sha256(json.dumps([self.sample_id, self.source_row]).encode())
        h.update(self.input_ids.astype(np.int64).tobytes())
        h.update(self.loss_mask.tobytes())
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
    (`input_sha256`), with no model's limits; None where there is no such input (any more) or it is not one."""
    try:
        return input_hash(load_input(Path(path), vocab_size=2**31, max_tokens=2**62))
    except (OSError, InputError):
        return None


def read_sample_ids(prepared_dir: Path) -> list[str]:
    import pandas as pd

    return list(pd.read_parquet(Path(prepared_dir) / SAMPLES_FILE, columns=["sample_id"])["sample_id"])


@dataclass(frozen=True)
class RowRules:
    """What every extraction input row must meet, checked on its arrays (a run reads millions of token ids)."""
    vocab_size: int
    max_tokens: int
    min_loss_tokens: int = 0

    def sample(self, sample_id: str, ids: np.ndarray, mask: np.ndarray | None, source_row: int,
               where: str) -> InputSample:
        """The checked sample from integer arrays; `mask` None: every token counts."""
        label = f"{where} (id {sample_id})"
        if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu":
            raise InputError(f"{label}: 'input_ids' must be a non-empty list of integers")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][:5].tolist()
            raise InputError(f"{label}: token ids {bad} outside the vocabulary 0..{self.vocab_size - 1}")
        if len(ids) > self.max_tokens:
            raise InputError(f"{label}: {len(ids)} tokens, the engine takes at most {self.max_tokens}")
        if mask is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        elif (mask.ndim != 1 or len(mask) != len(ids) or mask.dtype.kind not in "iu"
              or mask.min() < 0 or mask.max() > 1):
            raise InputError(f"{label}: 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})")
        sample = InputSample(sample_id, ids, mask, source_row)
        if sample.num_loss_tokens < self.min_loss_tokens:
            raise InputError(f"{label}: {sample.num_loss_tokens} loss tokens; validation needs at least "
                             f"{self.min_loss_tokens} (validate.min_loss_tokens)")
        return sample


def _sample_id(value, where: str) -> str:
    if value is None:
        raise InputError(f"{where}: no 'id'")
    sample_id = str(value)
    try:
        check_sample_id(sample_id)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    return sample_id


def check_row(row: dict, where: str, rules: RowRules) -> InputSample:
    """A JSON row, checked by `rules`."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with id, input_ids, loss_mask")
    if "id" not in row and "sample_id" not in row:
        raise InputError(f"{where}: no 'id'")
    sample_id = _sample_id(row.get("id", row.get("sample_id")), where)
    # no loss_mask: every token counts; a null one is refused as any other value that is not a list of 0/1
    return rules.sample(sample_id, _json_integers(row.get("input_ids")),
                        _json_integers(row["loss_mask"]) if "loss_mask" in row else None,
                        int(row.get("source_row", 0)), where)


def _json_integers(values) -> np.ndarray:
    """A JSON list of integers as int64 (one past int64's range as -1: outside every vocabulary and mask); any
    other value as an object array, which `RowRules` refuses: numpy would take floats and booleans for integers."""
    if not isinstance(values, list) or not set(map(type, values)) <= {int}:
        return np.array(values, dtype=object, ndmin=1)
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array([v if -2**63 <= v < 2**63 else -1 for v in values], dtype=np.int64)


def _jsonl_samples(path: Path, rules: RowRules) -> Iterator[tuple[str, InputSample]]:
    with path.open("rb") as lines:
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InputError(f"{path} line {n}: not UTF-8 text (byte {exc.start}: {exc.reason}); expected "
                                 "JSON lines of {id, input_ids, loss_mask}") from None
            except json.JSONDecodeError as exc:
                raise InputError(f"{path} line {n}: not JSON ({exc.msg})") from None
            if isinstance(row, dict):
                row.setdefault("source_row", n)
            label = f"{path} line {row.get('source_row', n) if isinstance(row, dict) else n}"
            yield label, check_row(row, label, rules)


def _flat_lists(table, name: str, table_path: Path, rows: list) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column read whole: row i is values[offsets[i]:offsets[i + 1]] (a null list is
    an empty one); a null inside a list is refused, naming its row (`rows`: the source rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(column)
    if values.null_count:
        first_null = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, first_null, side="right")) - 1
        raise InputError(f"{table_path} sample {rows[row]}: '{name}' holds a null")
    if not (pa.types.is_integer(values.type) or pa.types.is_null(values.type)):  # null: every list empty
        raise InputError(f"{table_path}: column '{name}' holds lists of {values.type}, not of integers")
    return values.to_numpy(zero_copy_only=False), offsets


def _table_samples(directory: Path, rules: RowRules) -> Iterator[tuple[str, InputSample]]:
    """A prepared directory's samples, each column read whole (pyarrow) and checked row by row on array views."""
    import pyarrow.parquet as pq

    table_path = directory / SAMPLES_FILE
    if not table_path.exists():
        raise InputError(f"{directory}: a directory without {SAMPLES_FILE} (run `eagle-states prepare`)")
    columns = ["sample_id", "source_row", "input_ids", "loss_mask"]
    table = pq.read_table(table_path)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise InputError(f"{table_path}: no column {', '.join(missing)} (written by `eagle-states prepare`)")
    rows = table.column("source_row").to_pylist()
    ids, id_offsets = _flat_lists(table, "input_ids", table_path, rows)
    masks, mask_offsets = _flat_lists(table, "loss_mask", table_path, rows)
    for i, (name, row) in enumerate(zip(table.column("sample_id").to_pylist(), rows)):
        if row is None:
            raise InputError(f"{table_path} sample at index {i}: no source_row")
        label = f"{table_path} sample {row}"
        yield label, rules.sample(_sample_id(name, label), ids[id_offsets[i]:id_offsets[i + 1]],
                           masks[mask_offsets[i]:mask_offsets[i + 1]], int(row), label)


def load_input(path: Path, vocab_size: int, max_tokens: int, min_loss_tokens: int = 0) -> list[InputSample]:
    """Every row of the extraction input, checked. Any bad row stops the run with an error naming the row:
    extraction input is meant to be prepared already, and silently dropping a row would make the dataset
    disagree with its input."""
    path = Path(path)
    rules = RowRules(vocab_size, max_tokens, min_loss_tokens)
    samples, seen = [], {}
    for label, sample in (_table_samples(path, rules) if path.is_dir() else _jsonl_samples(path, rules)):
        if sample.sample_id in seen:
            raise InputError(f"{label}: sample id {sample.sample_id} already used by row {seen[sample.sample_id]}")
        seen[sample.sample_id] = sample.source_row
        samples.append(sample)
    if not samples:
        raise InputError(f"{path}: no samples")
    return samples
