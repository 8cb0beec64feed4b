"""A model's identity, recorded in the manifest and part of every cache key: its config, tokenizer and chat
template, and a fingerprint of its weight files (hashing a trillion-parameter model on every run is no option)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle_states.dataset.files import hash_files, hash_json


class ModelError(ValueError):
    """The model directory is missing, or a file in it is unreadable: names the path and what is wrong."""


def read_model_config(model_dir: Path) -> dict:
    """config.json, with a message that says what is wrong when it is missing or broken."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is a file, not a directory" if model_dir.exists() else "does not exist"
        raise ModelError(f"model directory {model_dir} {what} (only local directories are read, not Hugging Face hub "
                         "ids: download the model first, e.g. `hf download ORG/NAME --local-dir DIR`)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{path} is missing: {model_dir} is not a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
    text_config = config.get("text_config", config) if isinstance(config, dict) else None
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size")
               if not isinstance(text_config, dict) or k not in text_config]
    if missing:
        raise ModelError(f"{path} lacks {', '.join(missing)}")
    return config


def check_weight_files(model_dir: Path) -> None:
    """Every safetensors file is as long as its header says: a truncated download fails here in milliseconds,
    not inside the engine after minutes of loading."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files and not list(Path(model_dir).glob("*.bin")):
        raise ModelError(f"{model_dir} has no weight files (*.safetensors or *.bin)")
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            try:
                header = json.loads(f.read(header_len)) if 0 < header_len <= size - 8 else None
            except (ValueError, UnicodeDecodeError):
                header = None
        if not isinstance(header, dict):
            raise ModelError(f"{path} is not a readable safetensors file (its header is cut or damaged)")
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if size < 8 + header_len + end:
            raise ModelError(f"{path} is truncated: {size:,} bytes, its header describes {8 + header_len + end:,}")


def _weights_fingerprint(model_dir: Path) -> str:
    """Fingerprint of the weight files without reading terabytes: name, size, the safetensors header (shapes,
    dtypes, offsets) and 16 sampled 64 KiB blocks of each file."""
    h = hashlib.sha256()
    for p in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                header_len = int.from_bytes(f.read(8), "little")
                h.update(f.read(header_len))
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(64 << 10))
    return h.hexdigest()


def model_identity(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    text_config = config.get("text_config", config)
    tokenizer_files = [model_dir / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                               "special_tokens_map.json", "tokenizer.model")]
    return {
        "path": str(model_dir.resolve()),
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "num_layers": int(text_config["num_hidden_layers"]),
        "hidden_size": int(text_config["hidden_size"]),
        "vocab_size": int(text_config["vocab_size"]),
        "config_sha256": hash_json(config),
        "weights_fingerprint": _weights_fingerprint(model_dir),
        "tokenizer_sha256": hash_files(tokenizer_files),
    }
