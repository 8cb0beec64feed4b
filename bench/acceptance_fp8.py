"""What fp8 storage costs a draft: the original dataset of a `bench/acceptance.py` run extracted again with
`extract.codec: fp8-e4m3` from the same prepared input, validated (its relative error per layer), and a draft
trained on it with the same recipe and served on the same held-out prompts; compare with that run's row "none".

    python bench/acceptance_fp8.py --bench-out work/bench-acceptance --model work/trained-target \\
        --out work/acceptance-fp8 --json bench/cpu-2026-12-02-acceptance/fp8.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-out", required=True, help="a bench/acceptance.py --out directory")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()

    from eagle_states import stages
    from eagle_states.acceptance.draft import DraftRecipe
    from eagle_states.acceptance.harness import heldout_prompts, run_acceptance, table
    from eagle_states.config import PipelineParams

    original, model, out = Path(args.bench_out) / "original", Path(args.model), Path(args.out)
    engine = json.loads((original / "dataset" / "manifest.json").read_text())["engine"]
    params = PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "prepare": {"max_length": 1024},  # bench/acceptance.py's default; the input is prepared already
        "extract": {"input": str(original / "prepared"), "dtype": engine["extract.dtype"], "max_model_len": 1280,
                    "layer_ids": engine["extract.layer_ids"],
                    "max_num_batched_tokens": engine["extract.max_num_batched_tokens"],
                    "shard_max_tokens": engine["extract.shard_max_tokens"], "codec": "fp8-e4m3"},
        "validate": {"report": str(out / "validation.json")},
        "output": {"dir": str(out / "dataset"), "prefect_results": str(out / "results")}})
    stages.extract(params)
    verdict = stages.validate(params)
    assert verdict.valid, verdict.failures
    report = run_acceptance(out / "dataset", out / "acceptance", recipe=DraftRecipe(args.epochs, args.max_steps),
                            controls=(), model=model, dtype=engine["extract.dtype"],
                            prompts=heldout_prompts(model, args.prompts, seed=2), max_tokens=args.max_tokens)
    print(table(report))
    sizes = {name: sum(s["bytes"] for s in json.loads((d / "manifest.json").read_text())["shards"])
             for name, d in (("original", original / "dataset"), ("fp8-e4m3", out / "dataset"))}
    result = {"relative_error_per_layer": verdict.summary["relative_error_per_layer"], "shard_bytes": sizes,
              "drafts": report["drafts"], "recipe": report["recipe"]}
    print(json.dumps({"relative_error_per_layer": result["relative_error_per_layer"], "shard_bytes": sizes}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
