"""Reading a finished dataset: `Dataset(dir)[sample_id]`, or iterate in shard order. The exporters read through it;
compressed shards are decoded here (`shard_file.ShardReader`), so nothing downstream sees the codec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from eagle_states.dataset.layout import (INDEX_FILE, LayerSelection, key_hidden_state, key_input_ids, key_loss_mask,
                                         shard_path)
from eagle_states.dataset.manifest import layer_selection, read_manifest
from eagle_states.dataset.shard_file import ShardReader


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
        self.layers: LayerSelection = layer_selection(self.manifest)
        self.index = pd.read_parquet(self.dir / INDEX_FILE)
        self._shard_of = dict(zip(self.index["sample_id"], self.index["shard"]))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.index["sample_id"])

    def _read(self, f: ShardReader, sample_id: str) -> Sample:
        return Sample(sample_id, f.get_tensor(key_input_ids(sample_id)), f.get_tensor(key_loss_mask(sample_id)),
                      [f.get_tensor(key_hidden_state(sample_id, slot)) for slot in self.layers.slots])

    def __getitem__(self, sample_id: str) -> Sample:
        with ShardReader(shard_path(self.dir, self._shard_of[sample_id]), self.threads) as f:
            return self._read(f, sample_id)

    def __iter__(self) -> Iterator[Sample]:
        for shard, rows in self.index.groupby("shard", sort=True):
            with ShardReader(shard_path(self.dir, shard), self.threads) as f:
                for sample_id in rows["sample_id"]:
                    yield self._read(f, sample_id)
