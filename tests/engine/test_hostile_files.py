"""A dataset is something users pull from remotes that others write, and put on disks they link in: nothing in
its files may make the code read or delete outside it, hang it, or pass changed bytes on (issue #30, points
2-6 and 8; the stored Prefect records of point 1 are tests/prefect/test_records.py)."""

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from eagle_states import stages
from eagle_states.config import PipelineParams
from eagle_states.dataset.files import sha256_file
from eagle_states.dataset.layout import OutsideDataset, shard_path
from eagle_states.dataset.manifest import BadManifest
from eagle_states.dataset.reader import ChangedShard, Dataset
from eagle_states.demo import write_demo_conversations
from eagle_states.extraction.driver import DatasetExists, Extraction
from eagle_states.validate import NotTheInput, validate_dataset


def pipeline_params(model, work, limit=6, **output) -> PipelineParams:
    """Demo conversations prepared into work/prepared and extracted into work/dataset, in small shards."""
    return PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "data": {"path": str(work / "conversations.jsonl"), "build_demo_if_missing": False},
        "prepare": {"out": str(work / "prepared"), "max_length": 200, "limit": limit},
        "extract": {"dtype": "float32", "shard_max_tokens": 256, "max_model_len": 256, "max_num_batched_tokens": 128,
                    "max_num_seqs": 16, "gpu_memory_utilization": 0.2},
        "validate": {"report": str(work / "validation.json")},
        "output": {"dir": str(work / "dataset"), "prefect_results": str(work / ".prefect-results"), **output}})


@pytest.fixture(scope="module")
def made(tmp_path_factory, llama_model):
    """A finished, validated dataset made from a prepared directory (the shape a run leaves)."""
    work = tmp_path_factory.mktemp("hostile")
    write_demo_conversations(work / "conversations.jsonl", count=12)
    params = pipeline_params(llama_model, work)
    stages.prepare(params)
    stages.extract(params)
    assert stages.validate(params).valid
    assert len(json.loads((work / "dataset" / "manifest.json").read_text())["shards"]) >= 2
    return work


@pytest.fixture
def work(tmp_path, made):
    """A copy of the made work directory, with the params that point at it."""
    return shutil.copytree(made, tmp_path / "w", symlinks=True)  # the validation record beside it included


def edit_manifest(dataset, change):
    manifest = json.loads((dataset / "manifest.json").read_text())
    change(manifest)
    (dataset / "manifest.json").write_text(json.dumps(manifest))


def test_finalize_deletes_only_its_own_files_in_a_linked_shards_directory(work, llama_model, tmp_path):
    # point 2: with shards/ a link to another disk, finalize deleted every other file in that directory
    dataset = work / "dataset"
    bigger_disk = tmp_path / "bigger-disk" / "states"
    shutil.move(dataset / "shards", bigger_disk)
    os.symlink(bigger_disk, dataset / "shards")
    theirs = [bigger_disk / "notes.txt", bigger_disk / "other-dataset.safetensors", bigger_disk / "shard-7.bin"]
    for path in theirs:
        path.write_text("not ours")
    stale = [bigger_disk / "shard-00042.safetensors", bigger_disk / ".shard-00000.safetensors.k2j4h5.tmp"]
    for path in stale:
        path.write_text("ours, from another plan")
    Extraction(pipeline_params(llama_model, work)).finalize()
    assert all(p.read_text() == "not ours" for p in theirs)
    assert not any(p.exists() for p in stale)
    assert validate_dataset(dataset).valid


@pytest.mark.parametrize("file", ["../elsewhere/x.safetensors", "/etc/passwd", "/dev/zero",
                                  "shards/../../elsewhere/x.safetensors", "shards/shard-00001.safetensors"])
def test_a_manifest_shard_path_that_is_not_the_shards_own_is_refused_unopened(work, file, capsys):
    # point 3: validate opened the outside file and said valid when its hash matched; export read it
    from eagle_states.cli import main

    dataset = work / "dataset"
    elsewhere = work / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    shutil.copy(shard_path(dataset, "shard-00000"), elsewhere / "x.safetensors")  # the same bytes, the same hash
    edit_manifest(dataset, lambda m: m["shards"][0].__setitem__("file", file))
    result = validate_dataset(dataset)
    assert not result.valid and "refused" in result.failures.iloc[0]["observed"]
    with pytest.raises(BadManifest, match="is not 'shards/shard-00000.safetensors'"):
        Dataset(dataset)
    assert main(["export", str(dataset), "--format", "speculators", "--out", str(work / "export")]) == 2
    assert "has not passed validation" in capsys.readouterr().err
    assert not (work / "export").exists()


def test_a_shard_name_that_climbs_out_is_refused(work):
    dataset = work / "dataset"
    edit_manifest(dataset, lambda m: m["shards"][0].__setitem__("name", "../../elsewhere/shard-00000"))
    assert not validate_dataset(dataset).valid
    with pytest.raises(OutsideDataset):
        shard_path(dataset, "../x")


def test_an_index_row_naming_a_shard_outside_the_manifest_is_refused(work):
    # point 3: an index.parquet whose shard column climbs out
    dataset = work / "dataset"
    index = pd.read_parquet(dataset / "index.parquet")
    index.loc[1, "shard"] = "../../elsewhere/shard-00000"
    index.to_parquet(dataset / "index.parquet", index=False)
    result = validate_dataset(dataset)
    assert ("index", "shard is one of the manifest's") in set(zip(result.failures["table"], result.failures["check"]))
    with pytest.raises(BadManifest, match="row 1: shard '../../elsewhere/shard-00000' is not one of"):
        Dataset(dataset)


def test_a_fifo_in_place_of_a_shard_is_refused_not_waited_on(work):
    # point 4: a FIFO in place of a shard hung validate, deaf to signals
    shard = shard_path(work / "dataset", "shard-00001")
    shard.unlink()
    os.mkfifo(shard)
    done = subprocess.run([sys.executable, "-m", "eagle_states", "validate", str(work / "dataset"), "--force",
                           "--report", str(work / "v.json")], capture_output=True, text=True, timeout=120, cwd=work)
    assert done.returncode == 1, done.stderr
    assert "not a regular file" in (work / "v_failures.csv").read_text()


def test_a_refused_run_leaves_the_finished_datasets_input_as_it_was(work, llama_model):
    # point 5: the refusal came after the dataset's own prepared input had been rewritten, and named nothing
    before = sha256_file(work / "prepared" / "samples.parquet")
    with pytest.raises(DatasetExists) as refused:
        stages.prepare(pipeline_params(llama_model, work, limit=4))
    assert "settings.limit: 6 there, 4 now" in str(refused.value) and "nothing was changed" in str(refused.value)
    assert sha256_file(work / "prepared" / "samples.parquet") == before
    assert not list(work.glob(".prepared.staging-*"))
    assert stages.validate(pipeline_params(llama_model, work), reuse=False).valid
    # settings that give the same samples are not refused (a new preparation of the same rows)
    assert stages.prepare(pipeline_params(llama_model, work, limit=6)).rows_written == 6


def test_the_refusal_of_another_model_names_the_setting_that_differs(work, llama_model):
    params = pipeline_params(llama_model, work).override({"extract.layer_ids": "2,3,8"})
    with pytest.raises(DatasetExists) as refused:
        Extraction(params)
    assert "engine.extract.layer_ids: [2, 4, 5, 8] there, [2, 3, 8] now" in str(refused.value)
    assert "layer_ids: [2, 4, 5, 8] there, [2, 3, 8] now" in str(refused.value)


def test_a_dataset_is_not_judged_against_another_runs_prepared_input(work, llama_model):
    # point 6: a run sharing prepare.out rewrote it; the first run's correct dataset was recorded INVALID
    other = pipeline_params(llama_model, work, limit=3, dir=str(work / "other-dataset"))
    assert stages.prepare(other).rows_written == 3  # other-dataset has no dataset yet: nothing to keep
    with pytest.raises(NotTheInput, match="is not the input .* was made from"):
        stages.validate(pipeline_params(llama_model, work), reuse=False)
    result = stages.validate(pipeline_params(llama_model, work), reuse=False, input_given=False)
    assert result.valid  # compared with nothing rather than with the other run's rows (a warning says so)


def test_changed_bytes_behind_a_reused_validation_are_caught_by_every_reader(work, capsys):
    # point 8: two bytes flipped with size and mtime kept: validation is reused, but export wrote the states
    from eagle_states.cli import main

    dataset = work / "dataset"
    shard = shard_path(dataset, "shard-00000")
    stat = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(stat.st_size // 2)
        two = f.read(2)
        f.seek(stat.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in two))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ChangedShard, match="shard-00000.safetensors: its digest is not the manifest's"):
        list(Dataset(dataset))
    with pytest.raises(ChangedShard):
        Dataset(dataset)[Dataset(dataset).sample_ids[0]]
    assert main(["export", str(dataset), "--format", "speculators-legacy", "--out", str(work / "export")]) == 2
    assert "its digest is not the manifest's" in capsys.readouterr().err
    assert not (work / "export" / "export.json").exists()
    assert not validate_dataset(dataset, reuse=False).valid
