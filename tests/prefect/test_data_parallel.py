"""`extract.data_parallel_size` on the command line (`eagle-states extract`, no server configured): engine workers
started on this machine for the run, one core each, fed through a temporary Prefect server; the dataset equals a
one-engine run's, byte for byte."""

import os
import subprocess

import yaml

from eagle_states.dataset.manifest import read_manifest
from helpers import BIN, extraction_params, random_prompts, write_prompt_jsonl

PROMPTS = random_prompts([1, 9, 40, 64, 65, 130, 17, 3], 300, seed=11)


def extract(tmp_path, params, out, dp):
    path = tmp_path / f"params-{dp}.yaml"
    path.write_text(yaml.safe_dump(params.override({"output.dir": str(out), "extract.data_parallel_size": dp})
                                   .model_dump(mode="json", by_alias=True)))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "VLLM_CPU_OMP_THREADS_BIND": "0"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([str(BIN / "eagle-states"), "extract", "--params", str(path), "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def test_two_local_engine_workers_write_the_same_dataset_as_one(tmp_path, llama_model):
    source = write_prompt_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    params = extraction_params(llama_model, source, tmp_path / "one", dtype="float32", shard_max_tokens=128,
                               max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                               gpu_memory_utilization=0.15)
    extract(tmp_path, params, tmp_path / "one", 1)
    log = extract(tmp_path, params, tmp_path / "two", 2)
    assert "2 local engine workers serve" in log
    one, two = (read_manifest(tmp_path / d) for d in ("one", "two"))
    assert len(one["shards"]) >= 4
    assert [s["blake3"] for s in two["shards"]] == [s["blake3"] for s in one["shards"]]
    assert (tmp_path / "two" / "manifest.json").read_bytes() == (tmp_path / "one" / "manifest.json").read_bytes()
    assert (tmp_path / "two" / "index.parquet").read_bytes() == (tmp_path / "one" / "index.parquet").read_bytes()
