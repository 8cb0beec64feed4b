"""DVC in a temporary git + DVC repository with a local remote: `dvc repro`, its no-op rerun, a parameter change,
publishing and getting a version back, a failed validation blocking publication, a failing push, and the Prefect
flow giving the same bytes as `dvc repro`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle_states.dataset.capture_format import CAPTURE_FORMAT_VERSION
from helpers import REPO

BIN = Path(sys.executable).parent
PROJECT_FILES = ["eagle_states", "flows", "tasks", "dvc.yaml", "params.yaml", "prefect.yaml", "pyproject.toml",
                 ".dvc/config", ".dvcignore", ".gitignore"]


def sh(*args, cwd, check=True, env=None):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})})
    if check and done.returncode:
        raise AssertionError(f"{' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def shard_hashes(dataset: Path) -> dict:
    return {s["name"]: s["blake3"] for s in json.loads((dataset / "manifest.json").read_text())["shards"]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("dvc")
    repo, remote = root / "repo", root / "remote"
    for name in PROJECT_FILES:
        source, target = REPO / name, repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["prepare"]["limit"] = 12
    params["extract"].update(shard_max_tokens=1536, max_num_batched_tokens=512)
    params["export"]["formats"] = ["speculators"]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "init", "-q", cwd=repo)
    sh("git", "config", "user.email", "ci@example.com", cwd=repo)
    sh("git", "config", "user.name", "CI", cwd=repo)
    sh("dvc", "remote", "modify", "local", "url", str(remote), cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-q", "-m", "project", cwd=repo)
    first = sh("dvc", "repro", cwd=repo)
    return repo, remote, first.stdout


def test_repro_runs_the_whole_pipeline(repo):
    repo, _, out = repo
    for stage in ("inputs", "prepare", "regenerate", "extract", "validate", "export"):
        assert f"Running stage '{stage}'" in out
    assert json.loads((repo / "work" / "validation.json").read_text())["valid"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"inputs", "prepare", "regenerate", "extract", "validate", "export"}
    assert json.loads((repo / "work" / "regenerated" / "report.json").read_text()) == {"enabled": False}
    manifest = json.loads((repo / "work" / "dataset" / "manifest.json").read_text())
    assert json.loads((repo / "work" / "exports" / "speculators" / "export.json").read_text())[
        "samples"] == manifest["num_samples"]


def test_second_repro_does_nothing(repo):
    repo, _, _ = repo
    out = sh("dvc", "repro", cwd=repo).stdout
    for stage in ("prepare", "regenerate", "extract", "validate"):
        assert f"Running stage '{stage}'" not in out, out


def test_an_edit_of_the_capture_that_changes_no_byte_leaves_dvc_clean(repo):
    """The extract stage depends on the declared capture format, not on the capture's source text (#28)."""
    repo, _, _ = repo
    edited = ["capture/worker.py", "capture/engine.py", "dataset/layout.py", "dataset/shard_file.py",
              "dataset/codec.py", "extraction/driver.py"]
    originals = {name: (repo / "eagle_states" / name).read_text() for name in edited + ["dataset/capture_format.py"]}
    try:
        for name in edited:
            with open(repo / "eagle_states" / name, "a") as f:
                f.write("\n# a comment that changes no shard\n")
        status = sh("dvc", "status", cwd=repo).stdout
        assert "extract:" not in status and "regenerate:" not in status, status
        version = repo / "eagle_states" / "dataset" / "capture_format.py"
        text = version.read_text()
        assert f"CAPTURE_FORMAT_VERSION = {CAPTURE_FORMAT_VERSION}\n" in text
        version.write_text(text.replace(f"CAPTURE_FORMAT_VERSION = {CAPTURE_FORMAT_VERSION}",
                                        f"CAPTURE_FORMAT_VERSION = {CAPTURE_FORMAT_VERSION + 1}"))
        status = sh("dvc", "status", cwd=repo).stdout
        assert "extract:" in status and "CAPTURE_FORMAT_VERSION" in status, status
    finally:
        for name, text in originals.items():
            (repo / "eagle_states" / name).write_text(text)


def test_settings_that_change_no_byte_leave_dvc_and_every_shard_cached(repo):
    repo, _, _ = repo
    original = (repo / "params.yaml").read_text()
    params = yaml.safe_load(original)
    params["extract"].update(write_threads=2, gpu_memory_utilization=0.15, max_model_len=3000)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        status = sh("dvc", "status", cwd=repo).stdout
        assert "extract:" not in status and "prepare:" not in status, status
        shards = {p.name: p.stat().st_mtime_ns for p in (repo / "work" / "dataset" / "shards").iterdir()}
        out = sh("eagle-states", "extract", "--no-progress", cwd=repo)
        assert "capture engine ready" not in out.stderr  # no model loaded: every shard's receipt still holds
        assert {p.name: p.stat().st_mtime_ns for p in (repo / "work" / "dataset" / "shards").iterdir()} == shards
    finally:
        (repo / "params.yaml").write_text(original)


def test_prefect_flow_and_dvc_repro_give_identical_bytes(repo):
    repo, _, _ = repo
    sh("eagle-states", "run", "--out", "work/flow-dataset", cwd=repo, env={"PREFECT_HOME": str(repo / ".ph")})
    dvc_dataset, flow_dataset = repo / "work" / "dataset", repo / "work" / "flow-dataset"
    assert shard_hashes(flow_dataset) == shard_hashes(dvc_dataset)
    assert (flow_dataset / "manifest.json").read_bytes() == (dvc_dataset / "manifest.json").read_bytes()
    # the run's working files are beside its dataset, not in the default dataset's
    assert (repo / "work" / "flow-dataset.prepared" / "samples.parquet").exists()
    assert json.loads((repo / "work" / "flow-dataset.validation.json").read_text())["valid"]
    shutil.rmtree(flow_dataset)


def test_publish_then_pull_the_version_into_a_fresh_clone(repo, tmp_path):
    repo, remote, _ = repo
    result = json.loads(sh("eagle-states", "publish", cwd=repo).stdout)
    assert result["pushed"] and result["version"].startswith("dataset-")
    assert sh("git", "tag", "--list", result["version"], cwd=repo).stdout.strip() == result["version"]
    clone = tmp_path / "clone"
    sh("git", "clone", "-q", str(repo), str(clone), cwd=tmp_path)
    sh("git", "checkout", "-q", result["version"], cwd=clone)
    sh("dvc", "pull", "-q", "extract", cwd=clone)
    assert shard_hashes(clone / "work" / "dataset") == shard_hashes(repo / "work" / "dataset")
    for shard in (clone / "work" / "dataset" / "shards").iterdir():
        assert shard.read_bytes() == (repo / "work" / "dataset" / "shards" / shard.name).read_bytes()
    got = tmp_path / "got"
    sh("dvc", "get", str(repo), "work/dataset/manifest.json", "--rev", result["version"], "-o", str(got),
       cwd=tmp_path)
    assert got.read_bytes() == (repo / "work" / "dataset" / "manifest.json").read_bytes()


def test_changing_a_layer_id_reruns_extract_and_validate_only(repo):
    repo, _, _ = repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["extract"]["layer_ids"] = [1, 4, 5, 8]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh("dvc", "repro", cwd=repo).stdout
    assert "Running stage 'extract'" in out and "Running stage 'validate'" in out
    assert "Running stage 'prepare'" not in out
    assert json.loads((repo / "work" / "dataset" / "manifest.json").read_text())["layer_ids"] == [1, 4, 5, 8]


def test_an_invalid_dataset_cannot_be_published(repo):
    repo, _, _ = repo
    tags_before = sh("git", "tag", cwd=repo).stdout
    shard = next((repo / "work" / "dataset" / "shards").glob("*.safetensors"))
    with open(shard, "r+b") as f:  # a byte changed after the dataset was finished
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert sh("eagle-states", "validate", cwd=repo, check=False).returncode == 1
    refused = sh("eagle-states", "publish", cwd=repo, check=False)
    assert refused.returncode != 0 and "has not passed validation" in refused.stderr
    assert sh("git", "tag", cwd=repo).stdout == tags_before
    sh("dvc", "checkout", "--force", cwd=repo)  # DVC puts the committed bytes back
    assert sh("eagle-states", "validate", cwd=repo, check=False).returncode == 0


def test_a_failing_push_is_retried_and_keeps_the_local_version(repo):
    repo, remote, _ = repo
    sh("dvc", "remote", "modify", "--local", "local", "url", "/proc/eagle-states-no-such-remote", cwd=repo)
    try:
        failed = sh("eagle-states", "publish", cwd=repo, check=False)
    finally:
        sh("dvc", "remote", "modify", "--local", "--unset", "local", "url", cwd=repo)
    assert failed.returncode == 3
    result = json.loads(failed.stdout)
    assert not result["pushed"] and "committed and tagged locally" in result["error"]
    assert failed.stderr.count("dvc push failed (attempt") == 3
    assert sh("git", "tag", "--list", result["version"], cwd=repo).stdout.strip() == result["version"]


def test_regenerating_with_capture_through_dvc(repo):
    """`regenerate.enabled` and `regenerate.capture` in params.yaml: the regenerate stage generates and captures
    (one model load), extract only finalizes, validate checks the dataset against the regenerated samples."""
    repo, _, _ = repo
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["regenerate"].update(enabled=True, capture=True, max_new_tokens=8)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh("dvc", "repro", cwd=repo)
    assert "Running stage 'regenerate'" in out.stdout and "Running stage 'prepare'" not in out.stdout
    assert (out.stdout + out.stderr).count("capture engine ready") == 1  # regenerate's; extract loads nothing
    report = json.loads((repo / "work" / "regenerated" / "report.json").read_text())
    manifest = json.loads((repo / "work" / "dataset" / "manifest.json").read_text())
    assert report["shards_captured"] == [s["name"] for s in manifest["shards"]]
    assert manifest["engine"]["regenerate.capture"] is True and manifest["num_samples"] == report["rows_written"]
    assert json.loads((repo / "work" / "validation.json").read_text())["valid"]
    assert "regenerate" in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    again = sh("dvc", "repro", cwd=repo).stdout
    assert "Running stage 'regenerate'" not in again and "Running stage 'extract'" not in again
