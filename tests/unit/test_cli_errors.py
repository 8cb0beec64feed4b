"""Bad input fails with one line that names the file and what is wrong (exit 2), before any engine or model load,
and leaves no output behind; what a user can act on about a run is said there too."""

import errno
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from eagle_states.capture.engine import CaptureEngine
from eagle_states.cli import main
from eagle_states.coordination.retry import is_permanent
from eagle_states.dataset.files import growing_file_huge, in_memory_filesystem
from eagle_states.extraction.driver import Extraction
from eagle_states.extraction.room import check_host_buffer
from helpers import extraction_params, model_too_big_for_the_disk, write_prompt_jsonl


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """Bad input is refused before anything expensive: an engine start here fails the test (an AssertionError,
    which the command line does not turn into exit 2)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started before the input was checked")
    monkeypatch.setattr(CaptureEngine, "__init__", refuse)


def fails(capsys, *argv) -> str:
    """Runs the command; asserts exit 2 and one line on stderr; returns that line."""
    assert main(list(argv)) == 2
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
    assert fails(capsys, "extract", "--model", str(llama_model), "--layer-ids", "1,2,x") == ("eagle-states extract: "
        "error: extract.layer_ids: layer ids '1,2,x': give 'eagle3' or integers separated by commas")
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


def told_of_spilling(caplog, llama_model, rows, out, spill_dir, checks: int = 1) -> list[str]:
    """What an extraction of `rows` into `out` with a 0.0001 GiB host buffer (steps of 64 tokens) and `spill_dir`
    says of spilling, its host buffer checked `checks` times (as a run checks it before the engine starts and in
    the run); read before a command line runs, which hands the root logger to Prefect's handlers."""
    extraction = Extraction(extraction_params(llama_model, rows, out, dtype="float32", host_buffer_gb=0.0001,
                                              max_num_batched_tokens=64, spill_dir=spill_dir and str(spill_dir)))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(checks):
            check_host_buffer(extraction, extraction.unfinished())
    return [r.getMessage() for r in caplog.records if "spill files" in r.getMessage()]


def test_a_sample_too_long_for_the_host_buffer_is_spilled_with_any_codec_where_the_settings_say(
        workdir, capsys, caplog, llama_model):
    """The capture's host memory is extract.host_buffer_gb whatever the samples' length: a sample whose steps
    cannot all fit (a tiny buffer still has 4 steps of room) goes through a spill file, beside its shard or in
    extract.spill_dir, uncompressed or with any codec; the run says so once, and a spill directory where no file can
    be made is named before the model loads."""
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5] * 100, [5] * 129, [5] * 90])
    for spill_dir in (None, workdir / "spill"):
        told = told_of_spilling(caplog, llama_model, rows, workdir / "ds", spill_dir, checks=2)
        where = f"in {spill_dir}" if spill_dir else "beside their shards"
        assert len(told) == 1 and f"host buffer go through spill files {where} (their states written and read " \
            "once more, twice with a GPU codec): 1 of 3. The longest: sample p001 (input row 2): 129 tokens x 4 " \
            "layers x hidden 256 x float32" in told[0]
        assert told[0].endswith("in steps of 64 tokens: it needs 0.00612 GiB, extract.host_buffer_gb is 0.0001; "
                                "raise it to keep them in memory")
    assert (workdir / "spill").is_dir()  # made if missing
    (workdir / "small.yaml").write_text("extract:\n  host_buffer_gb: 0.0001\n  max_num_batched_tokens: 64\n")
    for codec in ("none", "blosc2-zstd", "fp8-e4m3"):
        with pytest.raises(AssertionError, match="an engine was started"):  # spilled: on to the engine
            main(["extract", "--params", "small.yaml", "--model", str(llama_model), "--input", str(rows), "--out",
                  "ds", "--dtype", "float32", "--codec", codec])
        shutil.rmtree(workdir / "ds", ignore_errors=True)
    capsys.readouterr()  # their lines
    (workdir / "a-file").write_text("")
    (workdir / "blocked.yaml").write_text("extract:\n  host_buffer_gb: 0.0001\n  max_num_batched_tokens: 64\n"
                                          "  spill_dir: a-file/spill\n")
    line = fails(capsys, "extract", "--params", "blocked.yaml", "--model", str(llama_model), "--input", str(rows),
                 "--out", "ds", "--dtype", "float32")
    assert line.endswith("extract.spill_dir a-file/spill: Not a directory")
    assert not (workdir / "ds").exists()
    with pytest.raises(ValueError) as refused:  # and a flow run does not retry it
        told_of_spilling(caplog, llama_model, rows, workdir / "ds", workdir / "a-file" / "spill")
    assert is_permanent(refused.value)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not in_memory_filesystem("/dev/shm"), reason="no tmpfs here")
def test_spill_files_in_ram_are_told_to_go_to_a_disk(workdir, caplog, llama_model):
    """Shards into RAM: spill files beside them would be in RAM too, where spilling saves no memory; the run says
    how to keep them out of it, and says nothing of the kind once extract.spill_dir is on a disk."""
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5] * 100, [5] * 129, [5] * 90])
    in_ram = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        for spill_dir in (None, in_ram / "spill", workdir / "spill"):
            (told,) = told_of_spilling(caplog, llama_model, rows, in_ram / "ds", spill_dir)
            on_disk = spill_dir == workdir / "spill" and not in_memory_filesystem(workdir)
            assert ("The spill files are in RAM (tmpfs /dev/shm), where spilling saves no memory: set "
                    "extract.spill_dir to a directory on a disk" in told) != on_disk, told
    finally:
        shutil.rmtree(in_ram)


def test_a_spill_directory_without_room_for_every_spilled_sample_is_warned_of(workdir, caplog, llama_model):
    """Spill files go once read back, so they only pile up when the writers fall behind the capture: where their
    file system lacks room for every spilled sample at once (beyond the unfinished shards, where it holds those
    too), the run warns and goes on; with room, it says nothing of it."""
    huge = model_too_big_for_the_disk(llama_model, workdir)  # 1 GiB a token and layer in fp32
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5] * 100, [5] * 129, [5] * 90])
    extraction = Extraction(extraction_params(huge, rows, workdir / "ds", dtype="float32", host_buffer_gb=0.0001,
                                              max_num_batched_tokens=64, spill_dir=str(workdir / "spill")))
    with caplog.at_level(logging.WARNING):
        check_host_buffer(extraction, extraction.unfinished())
    room = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spill files may hold")]
    assert len(room) == 1, caplog.text  # one sample spills (129 tokens x 4 layers x 1 GiB); the shards: 319 tokens
    assert room[0].startswith(f"spill files may hold up to 138.51 GB at once in {workdir / 'spill'} (the "
                              "states of 1 spilled sample, if the shards' writers fall behind the capture); its file "
                              "system has 0.00 GB free beyond the unfinished shards' 342.52 GB: set "
                              "extract.spill_dir to a disk with room"), room[0]
    told = told_of_spilling(caplog, llama_model, rows, workdir / "ds2", workdir / "spill")
    assert len(told) == 1 and not any(message.startswith("spill files may hold") for message in told)


class Told(logging.Handler):
    """The messages of one logger: the command line hands the root logger's handlers to Prefect's, whose stream
    under pytest may be an earlier test's."""

    def __init__(self, logger: str, caplog):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        caplog.set_level(logging.INFO, logger=logger)  # under pytest the root logger stays at WARNING
        logging.getLogger(logger).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root: there it runs)")
def test_shards_into_a_tmpfs_without_huge_pages_are_told_how_to_give_it_some(workdir, caplog, llama_model):
    rows = write_prompt_jsonl(workdir / "rows.jsonl", [[5] * 20])
    told = Told("eagle_states.extraction.room", caplog)
    try:
        for huge in ("never", "within_size"):
            ram = workdir / f"ram-{huge}"
            ram.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64M,huge={huge}", "tmpfs", str(ram)], check=True)
            try:
                for _ in range(2):  # said once a process for each mount
                    with pytest.raises(AssertionError, match="an engine was started"):  # told before the engine
                        main(["extract", "--model", str(llama_model), "--input", str(rows), "--out", f"{ram}/ds",
                              "--dtype", "float32"])
            finally:
                subprocess.run(["umount", str(ram)], check=True)
            said = [message for message in told.messages if "huge pages" in message]
            told.messages.clear()
            if huge == "never":
                assert len(said) == 1 and said[0].startswith(f"shards go into tmpfs {ram}, mounted without huge "
                                                             "pages: the kernel writes each shard a 4 KiB page")
                assert said[0].endswith(f"`mount -o remount,huge={growing_file_huge()} {ram}`, as root")
            else:
                assert said == []
    finally:
        logging.getLogger("eagle_states.extraction.room").removeHandler(told)


def test_errors_that_stay_are_not_retried():
    for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
        assert is_permanent(OSError(code, "x"))
    assert not is_permanent(OSError(errno.EIO, "x")) and not is_permanent(ConnectionError("lost"))


def test_a_parameters_file_that_is_missing_or_not_yaml_is_one_line(workdir, capsys, llama_model):
    # issue #30.7: a --params that does not exist used to run the built-in demo silently
    line = fails(capsys, "run", "--params", "my-params.yaml", "--model", str(llama_model), "--out", "ds")
    assert line.endswith("parameters file not found: my-params.yaml")
    assert not (workdir / "work").exists() and not (workdir / "ds").exists()
    (workdir / "bad.yaml").write_text("extract:\n  layer_ids: [2, 4\nmodel: {}\n")
    line = fails(capsys, "prepare", "--params", "bad.yaml", "--model", str(llama_model))
    assert "bad.yaml: not valid parameters YAML (line" in line
    (workdir / "tag.yaml").write_text("model: !!python/object/apply:os.system ['touch pwned']\n")
    assert "tag.yaml: not valid parameters YAML" in fails(capsys, "prepare", "--params", "tag.yaml")
    assert not (workdir / "pwned").exists()
    (workdir / "list.yaml").write_text("- 1\n- 2\n")
    assert "list.yaml: a YAML list, not a mapping of sections" in fails(capsys, "prepare", "--params", "list.yaml")


def test_a_tokenizer_or_data_that_cannot_be_read_fails_at_once_and_leaves_no_prepared_output(workdir, capsys,
                                                                                            llama_model):
    # issue #30.9: a missing tokenizer.json took 20 s of transformers text; bad data left an empty X.prepared/
    no_vocab = shutil.copytree(llama_model, workdir / "no-vocab")
    (no_vocab / "tokenizer.json").unlink()
    line = fails(capsys, "prepare", "--model", str(no_vocab), "--data", str(write_prompt_jsonl(
        workdir / "rows.jsonl", [[5]])), "--out", "p")
    assert f"{no_vocab} has no tokenizer vocabulary" in line
    empty = workdir / "empty.jsonl"
    empty.write_text("\n\n")
    assert f"{empty} is empty" in fails(capsys, "run", "--model", str(llama_model), "--data", str(empty), "--out", "x")
    binary = workdir / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 100)
    assert "not UTF-8 text" in fails(capsys, "prepare", "--model", str(llama_model), "--data", str(binary),
                                     "--out", "p")
    assert not (workdir / "p").exists() and not (workdir / "x.prepared").exists()
    assert not list(workdir.glob(".p.*")) and not list(workdir.glob(".x.*"))


def test_a_manifest_that_is_not_ours_is_one_line_from_info_and_invalid_for_validate(workdir, capsys):
    # issue #30.9: a manifest that is a JSON list, or lacks `shards`, gave tracebacks
    from eagle_states.dataset.layout import FORMAT_NAME, FORMAT_VERSION

    ds = workdir / "ds"
    ds.mkdir()
    for manifest, said in (([1, 2], "a JSON list, not an object"),
                           ({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "layer_ids": [2]},
                            "model is missing; expected dict")):
        (ds / "manifest.json").write_text(json.dumps(manifest))
        assert said in fails(capsys, "info", str(ds))
        assert main(["validate", str(ds)]) == 1
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err


def test_a_killed_preparations_leftovers_go_with_the_next_one(workdir, llama_model):
    # issue #30.9: a `.skipped.jsonl.*.tmp` left by a kill during prepare was never removed
    from eagle_states import stages
    from eagle_states.config import PipelineParams
    from eagle_states.demo import write_demo_conversations

    data = write_demo_conversations(workdir / "conversations.jsonl")
    params = PipelineParams.model_validate({"model": {"path": str(llama_model), "build_demo_if_missing": False},
                                            "data": {"path": str(data)}, "prepare": {"out": str(workdir / "p")},
                                            "output": {"dir": str(workdir / "ds")}})
    dead = workdir / ".p.staging-999999999"  # a pid that cannot be alive
    dead.mkdir()
    (dead / ".skipped.jsonl.abc123.tmp").write_text("half")
    assert stages.prepare(params).rows_written > 0
    assert not dead.exists() and not list((workdir / "p").glob(".*"))


def test_a_full_disk_in_a_shard_writer_names_the_file_and_is_not_retried():
    # issue #30.9: ENOSPC said "No space left on device" without the path and the shard was computed once more
    from types import SimpleNamespace

    from eagle_states.capture.worker import _Capture
    from eagle_states.cli import error_line

    capture = object.__new__(_Capture)  # only its failure hand-off, as the assembler leaves it
    failure = OSError(errno.ENOSPC, "No space left on device", "/data/ds/shards/x.tmp")
    capture.rank, capture.assembler = 0, SimpleNamespace(take_failure=lambda: failure)
    with pytest.raises(OSError) as raised:
        capture._raise_failure()
    assert raised.value.errno == errno.ENOSPC and is_permanent(raised.value)
    assert error_line(raised.value) == "capture failed on rank 0: No space left on device: /data/ds/shards/x.tmp"
