"""What fp8 storage costs a draft, side by side in one run: the original dataset of a `bench/acceptance.py` run
extracted again from the same prepared input with a lossy fp8 codec (`--codec`: fp8-e4m3, or fp8-e4m3-ans on a
GPU), validated (its relative error per layer); then at each draft seed a draft trained on each of the two
datasets (the original's states as captured: bf16 on a GPU, fp32 on the CPU build) with the same recipe, served on
the same held-out prompts.

    python bench/acceptance_fp8.py --bench-out work/bench-acceptance --model work/trained-target \\
        --out work/acceptance-fp8 --json bench/cpu-2026-12-02-acceptance/fp8.json
    python bench/acceptance_fp8.py ... --codec fp8-e4m3-ans --device cuda --seeds 0,1 --epochs 4 --max-steps 1000
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
    ap.add_argument("--codec", default="fp8-e4m3", choices=("fp8-e4m3", "fp8-e4m3-ans"))
    ap.add_argument("--device", default="cpu", help="where the drafts train")
    ap.add_argument("--seeds", default="0", help="draft seeds, comma-separated: a draft per seed and dataset")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()

    from eagle_states import stages
    from eagle_states.acceptance.draft import DraftRecipe
    from eagle_states.acceptance.harness import heldout_prompts, run_acceptance
    from eagle_states.config import PipelineParams

    original, model, out = Path(args.bench_out) / "original", Path(args.model), Path(args.out)
    engine = json.loads((original / "dataset" / "manifest.json").read_text())["engine"]
    dtype = engine["extract.dtype"]
    params = PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "prepare": {"max_length": 1024},  # bench/acceptance.py's default; the input is prepared already
        "extract": {"input": str(original / "prepared"), "dtype": dtype, "max_model_len": 1280,
                    "layer_ids": engine["extract.layer_ids"],
                    "max_num_batched_tokens": engine["extract.max_num_batched_tokens"],
                    "shard_max_tokens": engine["extract.shard_max_tokens"], "codec": args.codec},
        "validate": {"report": str(out / "validation.json")},
        "output": {"dir": str(out / "dataset"), "prefect_results": str(out / "results")}})
    stages.extract(params)
    verdict = stages.validate(params)
    assert verdict.valid, verdict.failures
    datasets = {dtype: original / "dataset", args.codec: out / "dataset"}
    prompts = heldout_prompts(model, args.prompts, seed=2)
    rows = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        recipe = DraftRecipe(args.epochs, args.max_steps, seed=seed)
        for name, dataset in datasets.items():
            report = run_acceptance(dataset, out / f"acceptance-{name}-seed{seed}", recipe=recipe, controls=(),
                                    model=model, dtype=dtype, device=args.device, prompts=prompts,
                                    max_tokens=args.max_tokens)
            rows.setdefault(seed, {})[name] = report["drafts"][0]
    sizes = {name: sum(s["bytes"] for s in json.loads((d / "manifest.json").read_text())["shards"])
             for name, d in datasets.items()}
    print(f"drafts trained on {dtype} states and on the same states stored {args.codec} (relative error per layer "
          f"{verdict.summary['relative_error_per_layer']}; {sizes[dtype] / sizes[args.codec]:.2f} x fewer bytes)")
    print(f"{'seed':>4} | {dtype:>9} acceptance, length | {args.codec:>12} acceptance, length | ratio")
    for seed, row in rows.items():
        a, b = row[dtype], row[args.codec]
        print(f"{seed:>4} | {a['acceptance_rate']:>20.3f}, {a['mean_acceptance_length']:.2f} | "
              f"{b['acceptance_rate']:>23.3f}, {b['mean_acceptance_length']:.2f} | "
              f"{b['acceptance_rate'] / a['acceptance_rate']:.3f}")
    result = {"codec": args.codec, "states_dtype": dtype, "device": args.device,
              "relative_error_per_layer": verdict.summary["relative_error_per_layer"], "shard_bytes": sizes,
              "recipe": {"epochs": args.epochs, "max_steps": args.max_steps, "prompts": args.prompts,
                         "max_tokens": args.max_tokens}, "drafts_by_seed": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
