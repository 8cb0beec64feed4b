"""Exports into the layouts the EAGLE-3 trainers read, streamed sample by sample from a validated dataset.

speculators          OUT/hidden_states/hs_{i}.safetensors  hidden_states [T, L, H] (aux layers, then the final
                     state), token_ids [T]; OUT/ (a `datasets.save_to_disk` table: input_ids, loss_mask, seq_len,
                     row i <-> hs_{i}); OUT/token_freq.pt ({token id: count} over loss tokens); OUT/eagle3.json
                     (the aux layer ids a draft reads and vLLM captures, the final state's id)
speculators-legacy   OUT/data_{i}.pt  {"input_ids" [T], "hidden_states": [L x [T, H]], "loss_mask" [T]}
specforge            OUT/rows_{a}-{b}/data_{i}.ckpt  {"input_ids" [T], "loss_mask" [T], "hidden_state" [1, T, H]
                     (final state), "aux_hidden_state" [1, T, (L-1)*H] (aux layers concatenated)}

Every export records its source (the dataset's version) in OUT/export.json, written last. Each sample's file is
written atomically, so an interrupted export resumes where it stopped.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from eagle_states.dataset.files import atomic_write_bytes, atomic_write_json, sha256_file
from eagle_states.dataset.layout import LAYER_SEMANTICS, MANIFEST_FILE, LayerSelection
from eagle_states.dataset.reader import Dataset, Sample
from eagle_states.dataset.shard_file import write_shard_file
from eagle_states.validate import is_validated

FORMATS = ("speculators", "speculators-legacy", "specforge")
EAGLE3_FILE = "eagle3.json"  # the speculators export's layer record (eagle3_record)
EXPORT_FILE = "export.json"
SPECFORGE_ROWS_PER_DIR = 1000


class ExportRefused(ValueError):
    """Deterministic: the dataset is not validated, or the format cannot represent its layer list."""


def check_layers(layers: LayerSelection, fmt: str) -> None:
    """speculators and SpecForge split the list into aux layers + the final state: the last id must be N."""
    if fmt in ("speculators", "specforge"):
        if len(layers) < 2 or not layers.ends_with_final_state():
            raise ExportRefused(
                f"{fmt} takes the last captured layer as the final state (layer id {layers.num_layers} = the "
                f"output before the final norm) and the ones before it as aux layers; this dataset has layer ids "
                f"{list(layers.layer_ids)}")
        aux = list(layers.layer_ids[:-1])
        if aux != sorted(aux):
            # vLLM's EAGLE-3 feeds a draft its aux layers in ascending order whatever order its config lists them
            # in: a draft trained on another order would read every layer in the wrong place
            raise ExportRefused(f"{fmt}: the aux layer ids {aux} are not in ascending order, the order vLLM feeds "
                                "them to a draft; extract with them sorted")


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _path_for(out: Path, fmt: str, i: int) -> Path:
    if fmt == "speculators":
        return out / "hidden_states" / f"hs_{i}.safetensors"
    if fmt == "speculators-legacy":
        return out / f"data_{i}.pt"
    start = i // SPECFORGE_ROWS_PER_DIR * SPECFORGE_ROWS_PER_DIR
    return out / f"rows_{start}-{start + SPECFORGE_ROWS_PER_DIR}" / f"data_{i}.ckpt"


def _write_sample(path: Path, fmt: str, sample: Sample) -> None:
    ids = sample.input_ids.to(torch.long)
    mask = sample.loss_mask.to(torch.long)
    if fmt == "speculators":
        write_shard_file(path, {"hidden_states": torch.stack(sample.hidden_states, dim=1), "token_ids": ids})
    elif fmt == "speculators-legacy":
        atomic_write_bytes(path, _torch_bytes(
            {"input_ids": ids, "hidden_states": list(sample.hidden_states), "loss_mask": mask}))
    else:
        atomic_write_bytes(path, _torch_bytes({
            "input_ids": ids, "loss_mask": mask, "hidden_state": sample.hidden_states[-1][None],
            "aux_hidden_state": torch.cat(sample.hidden_states[:-1], dim=-1)[None]}))


def export_dataset(dataset_dir: Path, out: Path, fmt: str, progress: bool = True) -> dict:
    from tqdm import tqdm

    if fmt not in FORMATS:
        raise ExportRefused(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    dataset_dir, out = Path(dataset_dir), Path(out)
    if not is_validated(dataset_dir):
        raise ExportRefused(f"{dataset_dir} has not passed validation (or changed since); run "
                            f"`eagle-states validate {dataset_dir}` first")
    dataset = Dataset(dataset_dir)
    check_layers(dataset.layers, fmt)
    source = {"dataset": str(dataset_dir.resolve()), "manifest_sha256": sha256_file(dataset_dir / MANIFEST_FILE),
              "layer_ids": list(dataset.layers.layer_ids), "layer_semantics": LAYER_SEMANTICS, "format": fmt,
              "samples": len(dataset)}
    marker = out / EXPORT_FILE
    if marker.exists() and json.loads(marker.read_text())["manifest_sha256"] != source["manifest_sha256"]:
        raise ExportRefused(f"{out} holds an export of another dataset version; use an empty directory")
    marker.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    order = {sid: i for i, sid in enumerate(dataset.sample_ids)}  # file i = row i of the index
    written, table = 0, [None] * len(order)
    with tqdm(total=len(dataset), desc=f"export {fmt}", unit="sample", disable=not progress) as bar:
        for sample in dataset:  # one shard open at a time, one sample in memory
            i = order[sample.sample_id]
            path = _path_for(out, fmt, i)
            if not path.exists():
                _write_sample(path, fmt, sample)
                written += 1
            table[i] = (sample.input_ids.tolist(), sample.loss_mask.tolist())
            bar.update()
    if fmt == "speculators":
        _write_speculators_table(table, out)
        atomic_write_json(out / EAGLE3_FILE, eagle3_record(dataset))
    atomic_write_json(marker, {**source, "written_this_run": written})
    return json.loads(marker.read_text())


def eagle3_record(dataset: Dataset) -> dict:
    """What a trainer needs to know of the layers, written from the manifest: the aux layer ids a draft reads
    (its `eagle_aux_hidden_state_layer_ids`, which vLLM's EAGLE-3 captures at serve time: the residual stream
    entering each of those decoder layers, the manifest's own meaning), and the final state's id. Passed on
    explicitly: speculators falls back to [2, n//2, n-3] without them."""
    layers = dataset.layers
    return {"aux_layer_ids": list(layers.layer_ids[:-1]), "final_layer_id": layers.layer_ids[-1],
            "num_layers": layers.num_layers, "hidden_size": dataset.manifest["hidden_size"],
            "layer_semantics": LAYER_SEMANTICS, "verifier": dataset.manifest["model"].get("path")}


def _write_speculators_table(table: list[tuple[list[int], list[int]]], out: Path) -> None:
    """The preprocessed table speculators pairs with hs_{i} (row i), and its token frequencies."""
    import hashlib
    import shutil
    from collections import Counter

    from datasets import Dataset as HFDataset
    from datasets import DatasetInfo, Features, List, Value
    from datasets.table import InMemoryTable

    freq = Counter(t for ids, mask in table for t, m in zip(ids, mask) if m)
    # `from_dict`'s types (its input_ids as int32), with the fingerprint given: without one, `datasets` hashes the
    # whole table through dill, which fails on Python 3.12 with pyarrow 26 ("Can't pickle MonthDayNano")
    features = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int64")),
                         "seq_len": Value("int64")})
    columns = {"input_ids": [ids for ids, _ in table], "loss_mask": [mask for _, mask in table],
               "seq_len": [len(ids) for ids, _ in table]}
    arrow = InMemoryTable.from_pydict(columns, schema=features.arrow_schema)
    # `datasets`' cache key names the table's content, not its source: the same samples stored with another codec
    # (another manifest) export the same bytes
    digest = hashlib.sha256()
    for column in arrow.table.columns:
        for buffer in column.combine_chunks().buffers():
            digest.update(b"" if buffer is None else memoryview(buffer))
    hf = HFDataset(arrow, info=DatasetInfo(features=features), fingerprint=digest.hexdigest()[:16])
    hf.set_format(type="torch")  # as speculators' own preprocessing leaves it
    staging = out / ".table.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    hf.save_to_disk(str(staging))
    for item in staging.iterdir():  # beside hidden_states/, where speculators' loader looks
        item.replace(out / item.name)
    staging.rmdir()
    atomic_write_bytes(out / "token_freq.pt", _torch_bytes(dict(freq)))
