"""A model's identity, recorded in the manifest and part of every cache key: its config, tokenizer and chat
template, and a fingerprint of its weight files (hashing a trillion-parameter model on every run is no option)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle_states.dataset.files import hash_files, hash_json


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
    config = json.loads((model_dir / "config.json").read_text())
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



def model_context(model_dir: Path) -> int | None:
    """The positions the model was built for (config.json `max_position_embeddings`), if it says."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config).get("max_position_embeddings")
