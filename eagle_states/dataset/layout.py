"""The dataset's layout: what a layer id means, the directory's names, the tensor keys inside a shard and the
order of samples in a shard file. The capture writes by these names and every reader finds by them.

    DATASET/
      manifest.json                      format, layer ids + semantics, model identity, dtype, counts, shard hashes
      index.parquet                      one row per sample: sample_id, shard, num_tokens, num_loss_tokens, source_row
      shards/shard-NNNNN.safetensors     per sample: {sid}/input_ids [T], {sid}/loss_mask [T],
                                         {sid}/hidden_states/{slot} [T, H] for slot = 0..L-1 in manifest order
      receipts/shard-NNNNN.json          written after each shard is on disk (used for resume; not part of a
                                         finished dataset's identity)
      .claims/shard-NNNNN.json           while an engine worker computes the shard: which worker (heartbeat)

The manifest is written last: a directory without `manifest.json` is an unfinished extraction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FORMAT_NAME = "eagle-states"
FORMAT_VERSION = 1

# The one statement of what a layer id means. Everything that records or interprets layer ids refers to this.
LAYER_SEMANTICS = (
    "layer id k = the residual stream entering decoder layer k (k = 0 is the token embeddings); "
    "k = num_layers is the last decoder layer's output before the final norm"
)


@dataclass(frozen=True)
class LayerSelection:
    """The captured layers: `layer_ids[slot]` is the layer id stored at `slot` (the manifest's order, the
    `hidden_states/{slot}` keys, an export's list position). Resolved once from the parameters."""

    layer_ids: tuple[int, ...]
    num_layers: int  # the model's decoder layers: layer id num_layers is the final state before the norm

    @classmethod
    def resolve(cls, spec, num_layers: int) -> "LayerSelection":
        """`spec`: 'eagle3' (EAGLE-3's low, middle and high layer, then the final state: [2, N//2, N-3, N]) or a
        list of layer ids."""
        ids = [2, num_layers // 2, num_layers - 3, num_layers] if spec == "eagle3" else [int(k) for k in spec]
        if spec == "eagle3" and (len(set(ids)) != len(ids) or min(ids) < 0):
            raise ValueError(f"the EAGLE-3 default {ids} is not usable for a model of {num_layers} layers; "
                             "give layer ids")
        if not ids:
            raise ValueError("layer ids: empty list")
        bad = [k for k in ids if not 0 <= k <= num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside 0..{num_layers} ({LAYER_SEMANTICS})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer ids {ids} contain duplicates")
        return cls(tuple(ids), num_layers)

    def __len__(self) -> int:
        return len(self.layer_ids)

    @property
    def slots(self) -> range:
        return range(len(self.layer_ids))

    def layer_id(self, slot: int) -> int:
        return self.layer_ids[slot]

    def ends_with_final_state(self) -> bool:
        """Whether the last slot holds the final state before the norm (what speculators and SpecForge expect)."""
        return self.layer_ids[-1] == self.num_layers


# ---------------------------------------------------------------------------------------------------------------
# Names
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.parquet"
SHARDS_DIR = "shards"
RECEIPTS_DIR = "receipts"
CLAIMS_DIR = ".claims"  # engine workers' claims on the shards they compute; removed when the dataset is finalized

_SAMPLE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


def check_sample_id(sample_id: str) -> str:
    if not isinstance(sample_id, str) or not _SAMPLE_ID.match(sample_id):
        raise ValueError(f"sample id {sample_id!r}: use 1-200 characters of letters, digits, '.', '_', ':', '-'")
    return sample_id


_SHARD_NAME = re.compile(r"^shard-\d{5,9}$")
SHARD_SUFFIX, RECEIPT_SUFFIX = ".safetensors", ".json"


class OutsideDataset(ValueError):
    """A dataset's own files name a path that is not one of its shards (`../x`, an absolute path, another name):
    refused, never opened (a dataset is pulled from remotes that others write)."""


def shard_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}"


def check_shard_name(name) -> str:
    """Shard names are the only part of a dataset's paths that its files decide: nothing but `shard-NNNNN` may
    become a path, so no manifest or index entry can point outside the dataset."""
    if not isinstance(name, str) or not _SHARD_NAME.match(name):
        raise OutsideDataset(f"{name!r} is not a shard name (shard-NNNNN); refused")
    return name


def shard_path(dataset_dir: Path, name: str) -> Path:
    return Path(dataset_dir) / SHARDS_DIR / f"{check_shard_name(name)}{SHARD_SUFFIX}"


def shard_file_entry(name: str) -> str:
    """The `file` a manifest records for a shard: relative to the dataset, and nothing else is accepted."""
    return f"{SHARDS_DIR}/{check_shard_name(name)}{SHARD_SUFFIX}"


def manifest_shard_path(dataset_dir: Path, entry: dict) -> Path:
    """The file of a manifest's shard entry, refused unless it is exactly the shard's own path in the dataset."""
    path = shard_path(dataset_dir, entry.get("name"))
    if entry.get("file") != shard_file_entry(entry["name"]):
        raise OutsideDataset(f"manifest shard {entry['name']}: file {entry.get('file')!r} is not "
                             f"{shard_file_entry(entry['name'])!r}; refused")
    return path


def own_file_name(name: str, suffix: str) -> bool:
    """Whether a file name in shards/ or receipts/ is one the extraction writes: a shard's or receipt's name, or
    the temp name of one being written (`.NAME.XXXX.tmp`). Only those are ever deleted there: `shards/` may be a
    link to a directory on a bigger disk that holds other files."""
    if name.startswith(".") and name.endswith(".tmp"):
        name = name[1:].rsplit(".", 2)[0]
    return name.endswith(suffix) and bool(_SHARD_NAME.match(name.removesuffix(suffix)))


def receipt_path(dataset_dir: Path, name: str) -> Path:
    return Path(dataset_dir) / RECEIPTS_DIR / f"{check_shard_name(name)}{RECEIPT_SUFFIX}"


def claim_path(dataset_dir: Path, name: str) -> Path:
    return Path(dataset_dir) / CLAIMS_DIR / f"{name}.json"


def validation_record_path(dataset_dir: Path) -> Path:
    """Where a dataset's validation state lives: beside it (the dataset's own bytes stay the writer's), named after
    it, so that validating one dataset never changes what is known of another."""
    dataset_dir = Path(dataset_dir).resolve()
    return dataset_dir.parent / f".{dataset_dir.name}.validation.json"


def key_input_ids(sample_id: str) -> str:
    return f"{sample_id}/input_ids"


def key_loss_mask(sample_id: str) -> str:
    return f"{sample_id}/loss_mask"


def key_hidden_state(sample_id: str, slot: int) -> str:
    return f"{sample_id}/hidden_states/{slot}"


_KEY = re.compile(r"^(?P<sid>[^/]+)/(?:(?P<field>input_ids|loss_mask)|hidden_states/(?P<slot>\d+))$")


@dataclass(frozen=True)
class TensorKey:
    sample_id: str
    field: str  # "input_ids", "loss_mask" or "hidden_states"
    slot: int | None  # for hidden_states: the manifest slot


def parse_key(key: str) -> TensorKey | None:
    """None for a key that is not part of the contract."""
    m = _KEY.match(key)
    if not m:
        return None
    if m["field"]:
        return TensorKey(m["sid"], m["field"], None)
    return TensorKey(m["sid"], "hidden_states", int(m["slot"]))


def shard_sample_order(sample_ids: list[str]) -> list[str]:
    """The order in which samples appear in a shard file. Keys are stored sorted and all of a sample's keys
    share its `sample_id/` prefix, so they are contiguous and samples follow the order of `sample_id + "/"`."""
    return sorted(sample_ids, key=lambda sid: sid + "/")


INDEX_COLUMNS = ["sample_id", "shard", "num_tokens", "num_loss_tokens", "source_row"]
