"""The manifest: what a finished dataset is (format, layers and their meaning, model, dtype, counts, every shard's
hash). Written last by the extraction, read first by everything else."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_states.dataset.files import SHARD_DIGESTS, read_regular, recorded_digest
from eagle_states.dataset.layout import (FORMAT_NAME, FORMAT_VERSION, LAYER_SEMANTICS, MANIFEST_FILE, LayerSelection,
                                         OutsideDataset, manifest_shard_path)


def build_manifest(*, layers: LayerSelection, model: dict, dtype: str, shards: list[dict], num_samples: int,
                   num_tokens: int, num_loss_tokens: int, input_sha256: str, codec: dict, versions: dict,
                   extra: dict | None = None) -> dict:
    """`shards`: [{name, file, blake3 (sha256 before 2026-12-02), bytes, num_samples, num_tokens}], in shard order;
    `codec`: how the hidden states are stored (`codec.Codec.record()`; a dataset from before codecs has none,
    which reads as "none")."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layer_ids": list(layers.layer_ids),
        "layer_semantics": LAYER_SEMANTICS,
        "num_layers_captured": len(layers),
        "model": model,
        "hidden_size": model["hidden_size"],
        "dtype": dtype,
        "codec": codec,
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "input_sha256": input_sha256,
        "shards": shards,
        "versions": versions,
        **(extra or {}),
    }


class BadManifest(ValueError):
    """A manifest.json that is not one this project writes (not JSON, not an object, a field missing or of the
    wrong type, a shard path that is not the shard's own)."""


# The fields every reader relies on, with their types: checked once here, so no reader meets a KeyError.
_REQUIRED = {"layer_ids": list, "model": dict, "hidden_size": int, "dtype": str, "num_samples": int,
             "num_tokens": int, "num_loss_tokens": int, "shards": list, "versions": dict}
_REQUIRED_MODEL = {"num_layers": int, "vocab_size": int}
_REQUIRED_SHARD = {"name": str, "file": str, "bytes": int}


def read_manifest(dataset_dir: Path) -> dict:
    path = Path(dataset_dir) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{dataset_dir}: no {MANIFEST_FILE}; this is not a finished dataset")
    try:
        manifest = json.loads(read_regular(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadManifest(f"{path}: not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BadManifest(f"{path}: a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT_NAME:
        raise BadManifest(f"{path}: format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BadManifest(f"{path}: format version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}")
    _check_fields(path, "", manifest, _REQUIRED)
    _check_fields(path, "model.", manifest["model"], _REQUIRED_MODEL)
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            raise BadManifest(f"{path}: shards[{i}] is not an object")
        _check_fields(path, f"shards[{i}].", shard, _REQUIRED_SHARD)
        try:
            recorded_digest(shard)
        except KeyError:
            raise BadManifest(f"{path}: shards[{i}] has no digest ({' or '.join(SHARD_DIGESTS)})") from None
        try:
            manifest_shard_path(Path(dataset_dir), shard)
        except OutsideDataset as exc:
            raise BadManifest(f"{path}: {exc}") from None
    return manifest


def _check_fields(path: Path, prefix: str, obj: dict, fields: dict) -> None:
    for name, kind in fields.items():
        if not isinstance(obj.get(name), kind) or (kind is int and isinstance(obj.get(name), bool)):
            raise BadManifest(f"{path}: {prefix}{name} is {'missing' if name not in obj else repr(obj[name])[:60]}; "
                              f"expected {kind.__name__}")



def codec_record(manifest: dict) -> dict:
    """How the dataset's hidden states are stored (`codec.Codec.record()`); a dataset from before codecs stored them
    plain."""
    return manifest.get("codec", {"name": "none"})


def layer_selection(manifest: dict) -> LayerSelection:
    """The manifest's layers as recorded (not re-resolved: a validator must see what was written)."""
    return LayerSelection(tuple(manifest["layer_ids"]), manifest["model"]["num_layers"])
