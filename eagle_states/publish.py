"""Publishing a validated dataset as a version: DVC commit (cache + dvc.lock), a git commit and tag, DVC push.

`dvc get`/`dvc pull` at the tag returns exactly the published bytes. A dataset that has not passed validation (or
changed since) is refused. A push that still fails after its retries leaves the local version in place and says so.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

from eagle_states.dataset.files import sha256_file
from eagle_states.dataset.layout import MANIFEST_FILE
from eagle_states.dataset.manifest import read_manifest
from eagle_states.validate import is_validated

log = logging.getLogger(__name__)


class NotValidated(RuntimeError):
    pass


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def dataset_version(dataset_dir: Path) -> str:
    """A name that follows the content: the same dataset always gets the same version."""
    return "dataset-" + sha256_file(Path(dataset_dir) / MANIFEST_FILE)[:12]


def publish(repo: Path, dataset_dir: Path, push: bool = True, push_retries: int = 3,
            retry_delay_s: float = 2.0) -> dict:
    repo = Path(repo)
    if not is_validated(dataset_dir):
        raise NotValidated(f"{dataset_dir} has not passed validation (or changed since it did); it cannot be "
                           "published")
    version = dataset_version(dataset_dir)
    _run(["dvc", "commit", "--force", "--quiet"], repo)  # outputs into the cache, dvc.lock up to date
    _run(["git", "add", "dvc.lock", "dvc.yaml", "params.yaml"] +
         [str(p.relative_to(repo)) for p in repo.rglob(".gitignore") if ".dvc" not in p.parts and
          ".venv" not in p.parts], repo)
    if _run(["git", "status", "--porcelain", "--", "dvc.lock"], repo).strip() or \
            subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=repo).returncode:
        _run(["git", "commit", "-q", "-m", f"Publish {version}"], repo)
    tags = _run(["git", "tag", "--list", version], repo).split()
    if not tags:
        manifest = read_manifest(dataset_dir)
        _run(["git", "tag", "-a", version, "-m", json.dumps({k: manifest[k] for k in (
            "num_samples", "num_tokens", "layer_ids", "dtype")})], repo)
    commit = _run(["git", "rev-parse", "HEAD"], repo).strip()
    result = {"version": version, "commit": commit, "pushed": False}
    if not push:
        return result
    for attempt in range(1, push_retries + 1):
        try:
            _run(["dvc", "push", "--quiet"], repo)
            result["pushed"] = True
            return result
        except RuntimeError as exc:
            log.warning("dvc push failed (attempt %d of %d): %s", attempt, push_retries, exc)
            last = exc
            if attempt < push_retries:
                time.sleep(retry_delay_s * attempt)
    result["error"] = (f"dvc push failed {push_retries} times; {version} is committed and tagged locally "
                       f"(commit {commit[:12]}), run `dvc push` when the remote is back: {last}")
    log.error(result["error"])
    return result
