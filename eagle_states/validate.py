"""Schema validation of a dataset, read from its files rather than from what the writer believed.

Tables are built from safetensors headers (shapes, dtypes: no tensor loads; a compressed tensor's logical dtype and
shape are in the header's metadata) and from one streaming pass over the tensors (NaN/Inf, token ids, loss masks;
compressed ones CRC-checked and decoded), shard by shard with one tensor in memory at a time; then pandera
schemas that encode the data contract check them lazily, so every failure is reported at once.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

from eagle_states.dataset import layout
from eagle_states.dataset.codec import CorruptTensorError
from eagle_states.dataset.files import (NotARegularFile, atomic_write_bytes, atomic_write_json, check_regular,
                                        digest_matches, hash_files, hash_json, sha256_file)
from eagle_states.dataset.layout import LAYER_SEMANTICS
from eagle_states.dataset.manifest import BadManifest, codec_record, layer_selection, read_manifest
from eagle_states.dataset.prepared import SAMPLES_FILE, prepared_input_hash, read_sample_ids
from eagle_states.dataset.shard_file import CODE_OF_NAME, ShardReader
from eagle_states.dataset.step_codecs import require_decoder

log = logging.getLogger(__name__)
FAILURES_SUFFIX = "_failures.csv"


def failures_path(report: Path) -> Path:
    return Path(report).with_name(Path(report).stem + FAILURES_SUFFIX)


class ValidationFailed(Exception):
    """The dataset breaks the contract (deterministic: never retried)."""

    def __init__(self, result: "ValidationResult"):
        super().__init__(f"{len(result.failures)} validation failures; first: "
                         + "; ".join(f"{r.sample_id} slot {r.slot} (layer id {r.layer_id}): {r.check} "
                                     f"(observed {r.observed})"
                                     for r in result.failures.head(3).itertuples()))
        self.result = result


# ---------------------------------------------------------------------------------------------------------------
# Reading the files
@dataclass
class Tables:
    shards: pd.DataFrame
    samples: pd.DataFrame
    presence: pd.DataFrame  # every sample id expected or found: how often found, whether expected
    layers: pd.DataFrame
    keys: pd.DataFrame  # keys that are not part of the contract
    bytes_read: int = 0


def build_tables(dataset_dir: Path, manifest: dict, expected_ids: dict[str, str], content: bool = True) -> Tables:
    """`expected_ids`: sample id -> where it is expected (the index, the prepared input). Hidden-state rows carry
    their `slot` (from the key) and the `layer_id` the manifest puts there (-1 for a slot it does not have)."""
    import safetensors
    import torch

    dataset_dir = Path(dataset_dir)
    layers = layer_selection(manifest)
    shard_rows, sample_rows, layer_rows, stray_keys = [], {}, [], []
    bytes_read = 0
    for shard in manifest["shards"]:
        path = layout.manifest_shard_path(dataset_dir, shard)  # read_manifest refused any other path
        row = {"shard": shard["name"], "exists": path.exists(), "readable": False, "digest_matches": False,
               "codec": "", "error": ""}
        shard_rows.append(row)
        if not row["exists"]:
            row["error"] = "missing"
            continue
        try:
            f = ShardReader(path)  # the header, checked against the file's size: no tensor loads
            row["readable"], row["codec"] = True, f.codec.get("name")
        except (ValueError, json.JSONDecodeError, safetensors.SafetensorError, NotARegularFile) as exc:
            row["error"] = str(exc)
            continue
        row["digest_matches"] = digest_matches(path, shard)
        bytes_read += path.stat().st_size
        for key in f.keys():
            info = f.info(key)  # as captured: a compressed tensor's logical dtype and shape, from the header
            parsed = layout.parse_key(key)
            if parsed is None:
                stray_keys.append({"shard": shard["name"], "key": key, "shape": str(info["shape"])})
                continue
            sample = sample_rows.setdefault((shard["name"], parsed.sample_id), {
                "sample_id": parsed.sample_id, "shard": shard["name"], "num_slots": 0, "max_slot": -1,
                "input_ids_len": -1, "loss_mask_len": -1, "loss_tokens": -1, "ids_min": 0, "ids_max": 0,
                "ids_dtype": "", "mask_values_ok": True})
            shape = info["shape"]
            if parsed.field == "hidden_states":
                layer_id = layers.layer_id(parsed.slot) if parsed.slot < len(layers) else -1
                layer = {"sample_id": parsed.sample_id, "shard": shard["name"], "slot": parsed.slot,
                         "layer_id": layer_id,
                         "ndim": len(shape), "tokens": shape[0] if shape else -1,
                         "hidden": shape[1] if len(shape) > 1 else -1, "dtype": info["dtype"],
                         "decodes": True, "nan": 0, "inf": 0, "sq_err": info.get("sq_err", 0.0),
                         "sq_sum": info.get("sq_sum", 0.0)}
                if content:
                    try:
                        t = f.get_tensor(key)
                        layer["nan"] = int(torch.isnan(t).sum())
                        layer["inf"] = int(torch.isinf(t).sum())
                    except CorruptTensorError:
                        layer["decodes"] = False
                layer_rows.append(layer)
                sample["num_slots"] += 1
                sample["max_slot"] = max(sample["max_slot"], parsed.slot)
            elif parsed.field == "input_ids":
                sample["input_ids_len"] = shape[0] if len(shape) == 1 else -1
                sample["ids_dtype"] = info["dtype"]
                if content:
                    t = f.get_tensor(key)
                    sample["ids_min"], sample["ids_max"] = (int(t.min()), int(t.max())) if t.numel() else (0, 0)
            else:
                sample["loss_mask_len"] = shape[0] if len(shape) == 1 else -1
                if content:
                    t = f.get_tensor(key)
                    sample["loss_tokens"] = int(t.sum())
                    sample["mask_values_ok"] = bool(((t == 0) | (t == 1)).all())
    samples = pd.DataFrame(sample_rows.values(), columns=[
        "sample_id", "shard", "num_slots", "max_slot", "input_ids_len", "loss_mask_len", "loss_tokens", "ids_min",
        "ids_max", "ids_dtype", "mask_values_ok"])
    counts = samples["sample_id"].value_counts()
    presence = pd.DataFrame({"sample_id": sorted(set(expected_ids) | set(counts.index))})
    presence["occurrences"] = presence["sample_id"].map(counts).fillna(0).astype(int)
    presence["expected"] = presence["sample_id"].isin(set(expected_ids))
    states = pd.DataFrame(layer_rows, columns=["sample_id", "shard", "slot", "layer_id", "ndim", "tokens", "hidden",
                                               "dtype", "decodes", "nan", "inf", "sq_err", "sq_sum"])
    states = states.merge(samples[["sample_id", "shard", "input_ids_len"]], on=["sample_id", "shard"], how="left")
    return Tables(pd.DataFrame(shard_rows), samples, presence, states,
                  pd.DataFrame(stray_keys, columns=["shard", "key", "shape"]), bytes_read)


# ---------------------------------------------------------------------------------------------------------------
# The schemas: the contract, parameterized by the manifest
class _Coerced(pa.DataFrameModel):
    class Config:
        coerce = True  # column types as the contract says (an empty table has no inferred types)


def schemas(manifest: dict, min_loss_tokens: int):
    # (names differ from the columns: a class body cannot read an enclosing variable it also assigns)
    want_slots = len(manifest["layer_ids"])
    want_hidden = manifest["hidden_size"]
    want_dtype = CODE_OF_NAME[manifest["dtype"]]
    want_codec = codec_record(manifest)["name"]
    vocab = manifest["model"]["vocab_size"]

    class ShardSchema(_Coerced):
        shard: Series[str]
        exists: Series[bool] = pa.Field(eq=True)
        readable: Series[bool] = pa.Field(eq=True)
        digest_matches: Series[bool] = pa.Field(eq=True)
        codec: Series[str] = pa.Field(eq=want_codec)  # the manifest's codec stored every shard

    class SampleSchema(_Coerced):
        sample_id: Series[str]
        num_slots: Series[int] = pa.Field(eq=want_slots)
        max_slot: Series[int] = pa.Field(eq=want_slots - 1)
        input_ids_len: Series[int] = pa.Field(gt=0)
        loss_tokens: Series[int] = pa.Field(ge=min_loss_tokens)
        ids_min: Series[int] = pa.Field(ge=0)
        ids_max: Series[int] = pa.Field(lt=vocab)
        ids_dtype: Series[str] = pa.Field(isin=["I32", "I64"])
        mask_values_ok: Series[bool] = pa.Field(eq=True)

        @pa.dataframe_check
        def loss_mask_as_long_as_ids(cls, df: pd.DataFrame) -> Series[bool]:
            return df["loss_mask_len"] == df["input_ids_len"]

    class PresenceSchema(_Coerced):
        sample_id: Series[str]
        occurrences: Series[int] = pa.Field(eq=1)  # 0: missing, 2+: duplicated
        expected: Series[bool] = pa.Field(eq=True)  # in the index / the prepared input

    class LayerSchema(_Coerced):
        sample_id: Series[str]
        slot: Series[int] = pa.Field(ge=0, lt=want_slots)
        ndim: Series[int] = pa.Field(eq=2)
        hidden: Series[int] = pa.Field(eq=want_hidden)
        dtype: Series[str] = pa.Field(eq=want_dtype)
        decodes: Series[bool] = pa.Field(eq=True)  # a compressed tensor's stored bytes pass their CRC and decode
        nan: Series[int] = pa.Field(eq=0)
        inf: Series[int] = pa.Field(eq=0)

        @pa.dataframe_check
        def tokens_equal_input_ids(cls, df: pd.DataFrame) -> Series[bool]:
            return df["tokens"] == df["input_ids_len"]

    class KeySchema(_Coerced):
        key: Series[str] = pa.Field(isin=[])  # any key outside the contract is a failure

    return {"shards": ShardSchema, "samples": SampleSchema, "presence": PresenceSchema, "layers": LayerSchema,
            "keys": KeySchema}


FAILURE_COLUMNS = ["table", "sample_id", "slot", "layer_id", "check", "observed"]


def _failure(table: str, check: str, observed, sample_id: str = "", slot="", layer_id="") -> dict:
    """One row of the failures table: `slot` is a position in the manifest's layer list (shard rows), `layer_id`
    the layer id there (see LAYER_SEMANTICS); either is empty where it does not apply."""
    return {"table": table, "sample_id": sample_id, "slot": slot, "layer_id": layer_id, "check": check,
            "observed": observed}


def manifest_failures(manifest: dict, index: pd.DataFrame) -> list[dict]:
    out = []
    n = manifest["model"]["num_layers"]
    for slot, k in enumerate(manifest["layer_ids"]):
        if not 0 <= k <= n:
            out.append(_failure("manifest", f"layer id in 0..{n}", k, slot=slot, layer_id=k))
    if manifest.get("layer_semantics") != LAYER_SEMANTICS:
        out.append(_failure("manifest", "layer semantics", manifest.get("layer_semantics")))
    if manifest["num_samples"] != len(index):
        out.append(_failure("manifest", f"num_samples == {len(index)} (index)", manifest["num_samples"]))
    names = {s["name"] for s in manifest["shards"]}
    for row in index.loc[~index["shard"].isin(names)].itertuples():
        out.append(_failure("index", "shard is one of the manifest's", row.shard, row.sample_id))
    return out


def lossy_failures(manifest: dict, layers: pd.DataFrame) -> tuple[dict[int, float], list[dict]]:
    """A lossy codec's relative error per layer id (sqrt of the squared rounding error over the squared norm,
    summed over the dataset, as the capture measured them on the true states), and a failure for each layer past
    the codec's bound. ({}, []) for a lossless dataset."""
    codec = codec_record(manifest)
    if not codec.get("lossy"):
        return {}, []
    sums = layers.groupby("layer_id")[["sq_err", "sq_sum"]].sum()
    errors = {int(k): float((row.sq_err / row.sq_sum) ** 0.5) if row.sq_sum > 0 else 0.0
              for k, row in sums.iterrows()}
    bound = codec["max_relative_error"]
    return errors, [_failure("layers", f"{codec['name']} relative error <= {bound}", round(err, 5),
                             slot=list(manifest["layer_ids"]).index(k), layer_id=k)
                    for k, err in errors.items() if err > bound]


def _failure_rows(name: str, table: pd.DataFrame, error: pa.errors.SchemaErrors) -> list[dict]:
    """One failure row per failed check and table row; a row-wise check over several columns counts once."""
    rows, seen = [], set()
    for case in error.failure_cases.itertuples():
        index = case.index if case.index is not None and case.index in table.index else None
        record = None if index is None else table.loc[index]
        whole_row = case.schema_context == "DataFrameSchema"
        check = str(case.check) if whole_row or not case.column else f"{case.column}: {case.check}"
        if (index, check) in seen:
            continue
        seen.add((index, check))
        if record is not None and whole_row:
            observed = ", ".join(f"{c} {record[c]}" for c in ("tokens", "loss_mask_len", "input_ids_len")
                                 if c in record)
        else:
            observed = case.failure_case
        if record is not None and record.get("error"):  # a shard that cannot be read: say why
            observed = f"{observed} ({record['error']})"
        label = "" if record is None else str(record["sample_id"] if "sample_id" in record else record["shard"])
        has_slot = record is not None and "slot" in record
        rows.append(_failure(name, check, observed, label, slot=int(record["slot"]) if has_slot else "",
                             layer_id=int(record["layer_id"]) if has_slot and record["layer_id"] >= 0 else ""))
    return rows


@dataclass
class ValidationResult:
    valid: bool
    failures: pd.DataFrame
    summary: dict = field(default_factory=dict)


def validate_dataset(dataset_dir: Path, prepared_dir: Path | None = None, min_loss_tokens: int = 0,
                     report: Path | None = None, reuse: bool = True) -> ValidationResult:
    """Validate a dataset directory and record the outcome beside it (`layout.validation_record_path`). With
    `report`, the summary goes there too (and NAME_failures.csv beside it when invalid); reports live outside the
    dataset, whose bytes stay the writer's.

    A dataset found valid before is not read again (`reuse`) while its record's key still holds: the same
    manifest, every file of the dataset with the same size and modification time, the same validator code, the
    same settings and the same prepared input. Anything else is validated from the files.

    Raises OSError/FileNotFoundError when it cannot run (I/O, worth a retry); returns a result otherwise.
    """
    started = time.time()
    dataset_dir = Path(dataset_dir)
    try:
        manifest = read_manifest(dataset_dir)
    except BadManifest as exc:  # not one this project writes (a shard path leaving the dataset included)
        return _refused_manifest(dataset_dir, exc, report)
    require_decoder(dataset_dir, codec_record(manifest)["name"])
    key = _record_key(dataset_dir, manifest, prepared_dir, min_loss_tokens)
    record = read_record(dataset_dir)
    if reuse and record and record.get("key") == key and record["summary"].get("valid"):
        summary = {**record["summary"], "reused": True, "seconds": round(time.time() - started, 3)}
        if "relative_error_per_layer" in summary:  # JSON's keys are strings; a verdict's layer ids are ints
            summary["relative_error_per_layer"] = {int(k): v for k, v in summary["relative_error_per_layer"].items()}
        _write_report(report, summary, None)
        return ValidationResult(True, pd.DataFrame(columns=FAILURE_COLUMNS), summary)
    index = pd.read_parquet(check_regular(dataset_dir / layout.INDEX_FILE))
    expected = {sid: "index" for sid in index["sample_id"]}
    if prepared_dir is not None:
        check_made_from(dataset_dir, manifest, Path(prepared_dir))
        prepared = read_sample_ids(prepared_dir)
        for sid in prepared:
            expected.setdefault(sid, "prepared input")
        for sid in set(index["sample_id"]) - set(prepared):
            expected.pop(sid, None)  # in the dataset but not in the prepared input: unexpected
    tables = build_tables(dataset_dir, manifest, expected)
    failures = manifest_failures(manifest, index)
    for name, schema in schemas(manifest, min_loss_tokens).items():
        table = getattr(tables, name)
        try:
            schema.validate(table, lazy=True)
        except pa.errors.SchemaErrors as exc:
            failures += _failure_rows(name, table, exc)
    relative_errors, lossy = lossy_failures(manifest, tables.layers)
    failures += lossy
    if index["sample_id"].duplicated().any():
        for sid in index.loc[index["sample_id"].duplicated(), "sample_id"]:
            failures.append(_failure("index", "unique in index", "duplicate", sid))
    failures_frame = pd.DataFrame(failures, columns=FAILURE_COLUMNS)
    elapsed = time.time() - started
    summary = {
        "valid": failures_frame.empty, "samples": int(tables.samples["sample_id"].nunique()),
        "tokens": int(tables.layers.drop_duplicates("sample_id")["tokens"].clip(lower=0).sum()),
        "bytes": int(tables.bytes_read), "layers": manifest["layer_ids"], "dtype": manifest["dtype"],
        "codec": codec_record(manifest)["name"],
        **({"relative_error_per_layer": relative_errors} if relative_errors else {}),
        "shards": len(manifest["shards"]), "failures": len(failures_frame), "seconds": round(elapsed, 3),
        "gb_per_s": round(tables.bytes_read / 1e9 / elapsed, 3) if elapsed > 0 else None,
        "dataset_manifest_sha256": key["manifest_sha256"], "reused": False}
    atomic_write_json(layout.validation_record_path(dataset_dir), {"key": key, "summary": summary})
    _write_report(report, summary, failures_frame)
    return ValidationResult(failures_frame.empty, failures_frame, summary)


class NotTheInput(ValueError):
    """The prepared directory to compare with is not the input the dataset was made from."""


def check_made_from(dataset_dir: Path, manifest: dict, prepared_dir: Path) -> None:
    """Refuse to compare a dataset with a prepared input other than its own (the manifest's `input_sha256`):
    every sample would be reported missing or extra, and the dataset recorded invalid for another's rows."""
    found = prepared_input_hash(prepared_dir)
    if found != manifest.get("input_sha256"):
        raise NotTheInput(f"{prepared_dir} is not the input {dataset_dir} was made from (its samples hash "
                          f"{(found or 'none')[:12]}, the manifest's input_sha256 "
                          f"{str(manifest.get('input_sha256'))[:12]}); "
                          "give the prepared directory it was made from with --prepared, or none")


def _refused_manifest(dataset_dir: Path, exc: BadManifest, report: Path | None) -> ValidationResult:
    """A manifest no reader may follow: one failure, recorded (so `export` and `info` see an invalid dataset)."""
    failures = pd.DataFrame([_failure("manifest", "a manifest eagle-states writes", str(exc))],
                            columns=FAILURE_COLUMNS)
    summary = {"valid": False, "failures": 1, "reused": False, "error": str(exc)}
    atomic_write_json(layout.validation_record_path(dataset_dir), {
        "key": {"manifest_sha256": sha256_file(dataset_dir / layout.MANIFEST_FILE)}, "summary": summary})
    _write_report(report, summary, failures)
    return ValidationResult(False, failures, summary)


def _write_report(report: Path | None, summary: dict, failures: pd.DataFrame | None) -> None:
    if report is None:
        return
    atomic_write_json(Path(report), summary)
    if failures is None or failures.empty:
        failures_path(report).unlink(missing_ok=True)
    else:
        atomic_write_bytes(failures_path(report), failures.to_csv(index=False).encode())


def validator_version() -> str:
    """The code that decides a verdict: this module and the contract it checks."""
    package = Path(layout.__file__).resolve().parent.parent
    return hash_files([package / "validate.py", package / "dataset" / "layout.py", package / "dataset" / "codec.py",
                       package / "dataset" / "shard_file.py", package / "dataset" / "manifest.py",
                       package / "dataset" / "step_codecs.py"], root=package)[:16]


def _record_key(dataset_dir: Path, manifest: dict, prepared_dir: Path | None, min_loss_tokens: int) -> dict:
    files = [layout.MANIFEST_FILE, layout.INDEX_FILE, *(layout.shard_file_entry(s["name"]) for s in manifest["shards"])]
    stats = [(name, *(lambda st: (st.st_size, st.st_mtime_ns))((dataset_dir / name).stat())) for name in files
             if (dataset_dir / name).exists()]
    prepared = Path(prepared_dir) / SAMPLES_FILE if prepared_dir is not None else None
    return {"manifest_sha256": sha256_file(dataset_dir / layout.MANIFEST_FILE), "files": hash_json(stats),
            "validator": validator_version(), "min_loss_tokens": min_loss_tokens,
            "prepared": sha256_file(prepared) if prepared is not None and prepared.exists() else None}


def read_record(dataset_dir: Path) -> dict | None:
    """The dataset's validation record ({key, summary}), or None where it has none."""
    try:
        return json.loads(layout.validation_record_path(dataset_dir).read_text())
    except (OSError, ValueError):
        return None


def is_validated(dataset_dir: Path) -> bool:
    """True if the dataset's own validation record says it passed and its manifest is unchanged since."""
    record, manifest = read_record(Path(dataset_dir)), Path(dataset_dir) / layout.MANIFEST_FILE
    if not record or not manifest.exists():
        return False
    return bool(record["summary"].get("valid")) and record["key"]["manifest_sha256"] == sha256_file(manifest)
