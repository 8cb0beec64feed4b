"""The manifest: what a finished dataset is (format, layers and their meaning, model, dtype, counts, every shard's
hash). Written last by the extraction, read first by everything else."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_states.dataset.layout import FORMAT_NAME, FORMAT_VERSION, LAYER_SEMANTICS, MANIFEST_FILE, LayerSelection


def build_manifest(*, layers: LayerSelection, model: dict, dtype: str, shards: list[dict], num_samples: int,
                   num_tokens: int, num_loss_tokens: int, input_sha256: str, codec: dict, versions: dict,
                   extra: dict | None = None) -> dict:
    """`shards`: [{name, file, sha256, bytes, num_samples, num_tokens}], in shard order; `codec`: how the hidden
    states are stored (`codec.Codec.record()`; a dataset from before codecs has none, which reads as "none")."""
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


def read_manifest(dataset_dir: Path) -> dict:
    path = Path(dataset_dir) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{dataset_dir}: no {MANIFEST_FILE}; this is not a finished dataset")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}")
    return manifest



def codec_record(manifest: dict) -> dict:
    """How the dataset's hidden states are stored (`codec.Codec.record()`); a dataset from before codecs stored them
    plain."""
    return manifest.get("codec", {"name": "none"})


def layer_selection(manifest: dict) -> LayerSelection:
    """The manifest's layers as recorded (not re-resolved: a validator must see what was written)."""
    return LayerSelection(tuple(manifest["layer_ids"]), manifest["model"]["num_layers"])
