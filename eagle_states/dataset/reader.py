"""Reading a finished dataset: `Dataset(dir)[sample_id]`, or iterate in shard order. The exporters read through it;
compressed shards are decoded here (`shard_file.ShardReader`), so nothing downstream sees the codec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from eagle_states.dataset.layout import (INDEX_FILE, LayerSelection, key_hidden_state, key_input_ids, key_loss_mask,
                                         shard_path)
from eagle_states.dataset.files import check_regular, digest_matches
from eagle_states.dataset.manifest import BadManifest, codec_record, layer_selection, read_manifest
from eagle_states.dataset.shard_file import ShardReader
from eagle_states.dataset.step_codecs import require_decoder


class ChangedShard(ValueError):
    """A shard file whose bytes are not the ones the manifest records."""


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    hidden_states: list[torch.Tensor]  # L tensors of [T, H], one per slot of `Dataset.layers`


class Dataset:
    """Reads a finished dataset: `Dataset(dir)[sample_id]`, or iterate in shard order (one shard open at a time)."""

    def __init__(self, dataset_dir: Path, threads: int = 1):
        """`threads`: decoding threads per tensor for a compressed dataset (manifest `codec`)."""
        import pandas as pd

        self.dir, self.threads = Path(dataset_dir), threads
        self.manifest = read_manifest(self.dir)
        require_decoder(self.dir, codec_record(self.manifest)["name"])
        self.layers: LayerSelection = layer_selection(self.manifest)
        self.index = pd.read_parquet(check_regular(self.dir / INDEX_FILE))
        self._entries = {s["name"]: s for s in self.manifest["shards"]}
        for row, shard in enumerate(self.index["shard"]):
            if shard not in self._entries:
                raise BadManifest(f"{self.dir / INDEX_FILE}: row {row}: shard {shard!r} is not one of the "
                                  "manifest's shards; refused")
        self._shard_of = dict(zip(self.index["sample_id"], self.index["shard"]))
        self._verified: set[str] = set()

    def _open(self, shard: str) -> ShardReader:
        """A shard's reader, once its file has been checked against the manifest's digest (once per shard and
        Dataset): a shard that changed since it was written is refused, whatever a validation record says."""
        path = shard_path(self.dir, shard)
        if shard not in self._verified:
            if not digest_matches(path, self._entries[shard]):
                raise ChangedShard(f"{path}: its digest is not the manifest's: the file changed after it was "
                                   "written; refused (extract again to recompute it)")
            self._verified.add(shard)
        return ShardReader(path, self.threads)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.index["sample_id"])

    def _read(self, f: ShardReader, sample_id: str) -> Sample:
        return Sample(sample_id, f.get_tensor(key_input_ids(sample_id)), f.get_tensor(key_loss_mask(sample_id)),
                      [f.get_tensor(key_hidden_state(sample_id, slot)) for slot in self.layers.slots])

    def __getitem__(self, sample_id: str) -> Sample:
        with self._open(self._shard_of[sample_id]) as f:
            return self._read(f, sample_id)

    def __iter__(self) -> Iterator[Sample]:
        for shard, rows in self.index.groupby("shard", sort=True):
            with self._open(shard) as f:
                for sample_id in rows["sample_id"]:
                    yield self._read(f, sample_id)
