"""Do repeated extractions of the same inputs give the same shard bytes on this machine?

The full suite has failed, now and then, tests that compare two runs' bytes (a Prefect flow against `dvc repro`;
vLLM's own capture against ours on 299 of 300 samples). This runs one small extraction (the demo Llama model in
fp32, mixed lengths, chunked prefill: the golden-bytes settings) RUNS times on each of ENGINES engines and prints
each run's shard digests and how many distinct lists came out (1: deterministic here). Load the machine beside it
to perturb the timing.

    python bench/determinism_check.py --engines 3 --runs 6
"""

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--runs", type=int, default=6, help="extractions per engine")
    args = parser.parse_args()

    from eagle_states.capture.engine import EngineHolder
    from eagle_states.config import PipelineParams
    from eagle_states.dataset.manifest import read_manifest
    from eagle_states.demo import make_demo_model
    from eagle_states.extraction.driver import Extraction, run_extraction

    work = Path(tempfile.mkdtemp(prefix="determinism-"))
    try:
        model = make_demo_model(work / "llama")
        rng = random.Random(11)
        with open(work / "prompts.jsonl", "w") as f:
            for i, n in enumerate([37, 190, 3, 64, 129, 70, 11, 150, 90, 45, 200, 7, 120, 66, 33, 180]):
                f.write(json.dumps({"id": f"p{i:03d}", "input_ids": [rng.randrange(5, 500) for _ in range(n)],
                                    "loss_mask": [1] * n}) + "\n")
        digests = []
        for engine in range(args.engines):
            holder = EngineHolder()
            try:
                for run in range(args.runs):
                    out = work / f"e{engine}-r{run}"
                    params = PipelineParams().override({
                        "model.path": str(model), "model.build_demo_if_missing": False,
                        "extract.input": str(work / "prompts.jsonl"), "output.dir": str(out),
                        "extract.dtype": "float32", "extract.shard_max_tokens": 256, "extract.max_model_len": 256,
                        "extract.max_num_batched_tokens": 64, "extract.max_num_seqs": 4,
                        "extract.gpu_memory_utilization": 0.2, "prepare.max_length": 255})
                    run_extraction(Extraction(params), progress=False, engines=holder)
                    digests.append(tuple(s["blake3"][:12] for s in read_manifest(out)["shards"]))
                    print(f"engine {engine} run {run}: {' '.join(digests[-1])}", flush=True)
                    shutil.rmtree(out)
            finally:
                holder.close()
        print(f"distinct shard-digest lists: {len(set(digests))} of {len(digests)} runs")
        return 0 if len(set(digests)) == 1 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
