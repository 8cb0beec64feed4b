"""Bad input fails in a second with one line that names the file and what is wrong (exit 2), before any server,
engine or model load, and leaves no output behind."""

import errno
import json
import shutil
import time

import pytest

from eagle_states.cli import main
from helpers import model_too_big_for_the_disk, write_prompt_jsonl
from tasks.retry import is_permanent


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fails(capsys, *argv) -> str:
    """Runs the command; asserts exit 2 within two seconds and one line on stderr; returns that line."""
    started = time.monotonic()
    assert main(list(argv)) == 2
    assert time.monotonic() - started < 2, "checked before anything expensive"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_model_directory_problems(workdir, capsys, llama_model):
    line = fails(capsys, "run", "--model", "meta-llama/Llama-3.1-8B", "--out", "ds")
    assert "meta-llama/Llama-3.1-8B does not exist" in line and "not Hugging Face hub ids" in line
    broken = shutil.copytree(llama_model, workdir / "broken")
    (broken / "config.json").write_text("{not json")
    assert f"{broken}/config.json is not valid JSON" in fails(capsys, "prepare", "--model", str(broken))
    truncated = shutil.copytree(llama_model, workdir / "truncated")
    weights = truncated / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert f"{weights} is truncated" in fails(capsys, "run", "--model", str(truncated), "--out", "ds")
    assert not (workdir / "ds").exists()


def test_data_and_settings_problems(workdir, capsys, llama_model):
    assert "is a directory; give a JSON or JSONL file" in fails(
        capsys, "run", "--model", str(llama_model), "--data", str(workdir))
    assert fails(capsys, "extract", "--model", str(llama_model), "--layer-ids", "1,2,x") == \
        "eagle-states extract: error: extract.layer_ids: layer ids '1,2,x': give 'eagle3' or integers separated by commas"
    assert "layer ids [9] outside 0..8" in fails(capsys, "run", "--model", str(llama_model), "--layer-ids", "2,9")
    garbage = workdir / "garbage.jsonl"
    garbage.write_bytes(b'{"id": "a", "input_ids": [5], "loss_mask": [1]}\n\xff\xfe\x00binary\n')
    assert f"{garbage} line 2: not UTF-8 text" in fails(capsys, "extract", "--model", str(llama_model),
                                                         "--input", str(garbage), "--out", "ds")
    assert not (workdir / "ds").exists()


def test_a_row_validation_would_reject_is_refused_before_the_engine(workdir, capsys, llama_model):
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5, 6, 7], [8, 9]])
    lines = rows.read_text().splitlines()
    row = json.loads(lines[1])
    row["loss_mask"] = [0, 0]
    rows.write_text(lines[0] + "\n" + json.dumps(row) + "\n")
    line = fails(capsys, "extract", "--model", str(llama_model), "--input", str(rows), "--out", "ds")
    assert f"{rows} line 2 (id p001): 0 loss tokens; validation needs at least 1" in line


def test_a_dataset_that_does_not_fit_is_refused_before_the_model_loads(workdir, capsys, llama_model):
    huge = model_too_big_for_the_disk(llama_model, workdir)
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5] * 200] * 8)
    line = fails(capsys, "extract", "--model", str(huge), "--input", str(rows), "--out", "ds", "--dtype", "float32")
    assert "the unfinished shards need 1,717.99 GB (1,600 tokens x 4 layers x hidden 67108864 x float32)" in line
    assert f"{workdir}'s file system has" in line and line.endswith("GB free")
    assert not (workdir / "ds").exists()


def test_errors_that_stay_are_not_retried():
    for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
        assert is_permanent(OSError(code, "x"))
    assert not is_permanent(OSError(errno.EIO, "x")) and not is_permanent(ConnectionError("lost"))
