"""Acceptance side by side: drafts trained with one recipe on states from this project, on deliberately wrong
states (the controls), on states from speculators' own data generation (vLLM's `extract_hidden_states` path, the
peer), and on the target's own regenerated replies; each served by vLLM's EAGLE-3 on the same held-out prompts.
The two extractions (ours and the peer's) run on the same token ids in this one run, timed side by side.

    python bench/acceptance.py --model work/trained-target --out work/bench-acceptance --conversations 300 \\
        --prompts 16 --max-tokens 48 --json bench/cpu-2026-12-02-acceptance/bench.json

--model: a trained target (`eagle-states make-demo-model DIR --train-steps 160`; built there when missing).
The peer's path as speculators 0.9.0 runs it (`speculators generate-offline-data` against a vLLM server started
with `speculative_config={"method": "extract_hidden_states"}` and `ExampleHiddenStatesConnector`), here with
vLLM's offline `LLM` in a process of its own (bench/peer_extract.py): the same engine path without the HTTP hop;
on the CPU build through a synchronous copy of the connector (bench/peer_hs_connector.py: the shipped one writes
through CUDA streams).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def params_for(args, out: Path, **regenerate):
    from eagle_states.config import PipelineParams

    return PipelineParams.model_validate({
        "model": {"path": str(args.model), "build_demo_if_missing": False},
        "data": {"path": str(args.data), "build_demo_if_missing": False},
        "prepare": {"out": str(out / "prepared"), "max_length": args.max_length, "limit": args.conversations},
        "regenerate": {"out": str(out / "regenerated"), **regenerate},
        "extract": {"dtype": args.dtype, "max_model_len": args.max_length + 256,
                    "max_num_batched_tokens": 4096, "shard_max_tokens": 16384,
                    **({"layer_ids": args.layer_ids} if args.layer_ids else {})},
        "validate": {"report": str(out / "validation.json")},
        "output": {"dir": str(out / "dataset"), "prefect_results": str(out / "results")}})


def peer_export(model: Path, ours: Path, out: Path, layer_ids: list[int], dtype: str) -> dict:
    """bench/peer_extract.py in its own process (its engine core must run in a process of its own)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "peer_extract.py"), str(model),
                           str(ours), str(out), "--layer-ids", ",".join(map(str, layer_ids)), "--dtype", dtype],
                          capture_output=True, text=True)
    if done.returncode:  # vLLM states the cause before a long traceback: the whole of it in a file
        log = out.parent / f"{out.name}.stderr.log"
        log.write_text(done.stderr)
        raise RuntimeError(f"bench/peer_extract.py failed (exit {done.returncode}), its stderr in {log}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"seconds"')))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", help="conversations (default: demo conversations of seed 0)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", help="extraction and serving (float32 on a CPU: bf16 is emulated)")
    ap.add_argument("--epochs", type=int, default=3, help="at most; --max-steps stops every draft at the same step "
                                                         "count (the regenerated replies are fewer tokens)")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="per regenerated turn")
    ap.add_argument("--recipe", help="the demo conversations' recipe (default: the target's, from its "
                                     "target_training.json; chat without one); also the target's when it is built")
    ap.add_argument("--layer-ids", help="the extraction's layer ids, e.g. 1,4,7,8 (default: the pipeline's)")
    ap.add_argument("--controls", default="token-shift,layer-off-by-one",
                    help="controls beside the correct draft (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="where the target (when built) and the drafts train")
    ap.add_argument("--speculators-train", action="store_true",
                    help="also the correct draft trained by `speculators train` itself (a CUDA device)")
    ap.add_argument("--target-steps", type=int, default=160, help="training steps of a target built here")
    ap.add_argument("--target-shape", default="8,256", help="layers,hidden of a target built here")
    ap.add_argument("--target-conversations", type=int, default=2000, help="a built target's training set")
    ap.add_argument("--skip", default="", help="comma-separated: peer (its extraction and draft), regenerated")
    ap.add_argument("--json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # a long run's progress

    from eagle_states import stages
    from eagle_states.acceptance.draft import DraftRecipe, train_draft
    from eagle_states.acceptance.harness import heldout_prompts, run_acceptance, table
    from eagle_states.capture.engine import EngineHolder
    from eagle_states.capture.speculative import measure_acceptance
    from eagle_states.demo import write_demo_conversations
    from eagle_states.demo_training import TRAINING_FILE, train_demo_model
    from eagle_states.export import export_dataset
    from eagle_states.extraction.driver import Extraction, run_extraction

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = Path(args.model)
    if not (args.model / "config.json").exists():
        layers, hidden = map(int, args.target_shape.split(","))
        train_demo_model(args.model, steps=args.target_steps, recipe=args.recipe or "chat", device=args.device,
                         conversations=args.target_conversations, num_layers=layers, hidden_size=hidden,
                         num_heads=hidden // 64)
    trained = args.model / TRAINING_FILE
    recipe_name = args.recipe or (json.loads(trained.read_text()).get("recipe", "chat") if trained.exists() else "chat")
    args.data = Path(args.data) if args.data else write_demo_conversations(out / "conversations.jsonl",
                                                                           2 * args.conversations, recipe=recipe_name)
    recipe = DraftRecipe(epochs=args.epochs, max_steps=args.max_steps)
    prompts = heldout_prompts(args.model, args.prompts, seed=2)
    serve = dict(prompts=prompts, max_tokens=args.max_tokens, dtype=args.dtype)

    original = params_for(args, out / "original")
    stages.prepare(original)
    extraction = Extraction(original)
    engines = EngineHolder()
    engines(extraction.engine_settings())  # loaded before the clock starts, as the peer's
    started = time.monotonic()
    run_extraction(extraction, progress=False, engines=engines)
    ours_s = time.monotonic() - started
    engines.close()
    assert stages.validate(original).valid
    report = run_acceptance(out / "original" / "dataset", out / "original" / "acceptance", recipe=recipe,
                            controls=[c for c in args.controls.split(",") if c], model=args.model,
                            device=args.device, speculators_train=args.speculators_train, **serve)
    rows = {row["draft"]: row for row in report["drafts"]}
    tokens = json.loads((out / "original" / "dataset" / "manifest.json").read_text())["num_tokens"]

    def trained(record: dict) -> dict:
        return {"train_final_loss": record["final_loss"], "train_steps": record["steps"], "val": record["val"],
                "trained_on_layer_ids": record["trained_on_layer_ids"]}

    skip = set(filter(None, args.skip.split(",")))
    peer_s, peer = None, {}
    if "peer" not in skip:
        peer_dir = out / "peer" / "export"
        peer = peer_export(args.model, out / "original" / "acceptance" / "export", peer_dir,
                           report["manifest_layer_ids"], args.dtype)
        peer_s = peer["seconds"]
        peer_trained = trained(train_draft(peer_dir, args.model, out / "peer" / "draft", recipe, device=args.device))
        rows["peer (speculators' data generation)"] = {
            "draft": "peer", **measure_acceptance(args.model, out / "peer" / "draft", **serve).summary(),
            **peer_trained}

    regenerated_tokens = None
    if "regenerated" not in skip:
        regenerated = params_for(args, out / "regenerated", enabled=True, max_new_tokens=args.max_new_tokens)
        stages.regenerate(regenerated)
        stages.extract(regenerated)
        assert stages.validate(regenerated).valid
        export_dataset(out / "regenerated" / "dataset", out / "regenerated" / "export", "speculators", progress=False)
        regenerated_trained = trained(train_draft(out / "regenerated" / "export", args.model,
                                                  out / "regenerated" / "draft", recipe, device=args.device))
        rows["regenerated replies"] = {
            "draft": "regenerated", **measure_acceptance(args.model, out / "regenerated" / "draft", **serve).summary(),
            **regenerated_trained}
        regenerated_tokens = json.loads((out / "regenerated" / "dataset" / "manifest.json").read_text())["num_tokens"]

    result = {"model": str(args.model), "conversations_recipe": recipe_name,
              "layer_ids": report["manifest_layer_ids"], "tokens": tokens, "regenerated_tokens": regenerated_tokens,
              "recipe": report["recipe"], "prompts": len(prompts),
              "extraction_s": {"eagle-states": round(ours_s, 2), "speculators (peer)": peer_s},
              "extraction_tokens_per_s": {"eagle-states": round(tokens / ours_s),
                                          "speculators (peer)": round(tokens / peer_s) if peer_s else None},
              "peer_states_bitwise_equal_to_ours": f"{peer['bitwise_equal_to_ours']} of {peer['samples']}"
              if peer else None,
              "drafts": rows}
    print(table({"drafts": [{**r, "draft": name, "train_final_loss": r.get("train_final_loss", float("nan")),
                             "trained_on_layer_ids": r.get("trained_on_layer_ids", report["manifest_layer_ids"][:-1])}
                            for name, r in rows.items()]}))
    print(json.dumps(result["extraction_tokens_per_s"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
