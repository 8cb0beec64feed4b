"""Regenerate and capture in one pass (`regenerate.capture`) against regenerate, then capture (the usual second,
prefill pass over the regenerated token ids), interleaved on one engine in one process; and generation alone (no
states at all), the floor both stand on. Each round runs the three in the next order in turn, each into fresh
directories, through the pipeline's own steps (`regenerate.regenerate`, `Extraction`: files, receipts, manifest).

    python bench/regenerate_speed.py --model work/demo-model --out work/bench-regenerate --conversations 64 \\
        --max-new-tokens 64 --rounds 2 --json work/bench-regenerate.json

Prints, per mode, the median seconds, the dataset's tokens per second (every token of the final conversations, the
unit of the other benches) and the ratio of the one pass to the two. Without --data the demo conversations are used.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

MODES = ("generate", "one-pass", "two-pass")


def params_for(args, out: Path, mode: str):
    from eagle_states.config import PipelineParams

    return PipelineParams.model_validate({
        "model": {"path": args.model, "build_demo_if_missing": False},
        "data": {"path": str(args.data), "build_demo_if_missing": False},
        "prepare": {"max_length": args.max_length, "limit": args.conversations, "out": str(out / "prepared")},
        "regenerate": {"enabled": True, "capture": mode == "one-pass", "max_new_tokens": args.max_new_tokens,
                       "out": str(out / "regenerated")},
        "extract": {"dtype": args.dtype, "max_model_len": args.max_length + 1,
                    "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                    "shard_max_tokens": args.shard_max_tokens, "write_threads": args.write_threads,
                    "gpu_memory_utilization": args.gpu_memory_utilization},
        "validate": {"report": str(out / "validation.json")},
        "output": {"dir": str(out / "dataset"), "prefect_results": str(out / "results")}})


def run_mode(args, engines, out: Path, mode: str) -> dict:
    # the steps' own functions, not `stages`, whose validation imports pandera (not in the GPU kit)
    from eagle_states import regenerate
    from eagle_states.extraction.driver import Extraction, run_extraction

    shutil.rmtree(out, ignore_errors=True)
    params = params_for(args, out, mode)
    before = engines.engine.capture_stats() if engines.engine else None
    started = time.perf_counter()
    regenerate.regenerate(params, engines, identity="bench")
    generated_s = time.perf_counter() - started
    tokens = None
    if mode != "generate":  # one pass: every shard is on disk, this only finalizes; two passes: the prefill
        tokens = run_extraction(Extraction(params), progress=False, engines=engines)["num_tokens"]
    seconds = time.perf_counter() - started
    after = engines.engine.capture_stats()
    # where the time went, on the device's timeline: in forward passes, and idle between them (the host's loop)
    counters = {key: getattr(after, key) - (getattr(before, key) if before else 0)
                for key in ("forwards", "forward_s", "between_forwards_s", "pinned_wait_s", "generated_rows")}
    report = json.loads((out / "regenerated" / "report.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "seconds": seconds, "generation_s": generated_s, "tokens": tokens or report["num_tokens"],
            "generated_tokens": report["tokens_generated"], "conversations": report["rows_written"],
            "shards_captured": len(report["shards_captured"]), **counters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="work/demo-model", help="default: %(default)s")
    parser.add_argument("--data", help="conversations (default: the demo conversations, written into --out)")
    parser.add_argument("--out", default="work/bench-regenerate", help="default: %(default)s")
    parser.add_argument("--conversations", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per turn (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--dtype", default="float32", help="default: %(default)s")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default: %(default)s")
    parser.add_argument("--shard-max-tokens", type=int, default=8192, help="default: %(default)s")
    parser.add_argument("--write-threads", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="default: %(default)s")
    parser.add_argument("--switch-interval", type=float, help="Python's thread switch interval in this process, "
                        "the engine's (default: Python's, 0.005 s)")
    parser.add_argument("--json", help="write the rounds and medians here")
    args = parser.parse_args()
    if args.switch_interval:
        import sys

        sys.setswitchinterval(args.switch_interval)

    from eagle_states.capture.engine import EngineHolder
    from eagle_states.demo import write_demo_conversations

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.data:
        args.data = write_demo_conversations(out / "conversations.jsonl", count=max(64, args.conversations))
    engines = EngineHolder()
    try:
        warm = argparse.Namespace(**{**vars(args), "conversations": max(1, args.conversations // 8)})
        for mode in MODES:  # the model's load and the first batches' warm-up, in no mode's time
            run_mode(warm, engines, out / "warm-up", mode)
        rounds = []
        for i in range(args.rounds):
            order = MODES[i % 3:] + MODES[:i % 3]
            for mode in order:
                row = {"round": i, "order": order.index(mode), **run_mode(args, engines, out / f"{i}-{mode}", mode)}
                rounds.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engines.close()
    medians = {mode: {key: statistics.median(r[key] for r in rounds if r["mode"] == mode)
                      for key in ("seconds", "generation_s", "tokens", "generated_tokens", "forwards", "forward_s",
                                  "between_forwards_s", "pinned_wait_s")} for mode in MODES}
    for mode, m in medians.items():
        m["tokens_per_s"] = m["tokens"] / m["seconds"]
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds, "medians": medians,
              "one_pass_vs_two_pass": medians["two-pass"]["seconds"] / medians["one-pass"]["seconds"],
              "one_pass_vs_generation_alone": medians["generate"]["seconds"] / medians["one-pass"]["seconds"]}
    print(f"{'mode':<10} {'seconds':>9} {'generation s':>13} {'tokens':>9} {'tokens/s':>10} {'forwards':>9} "
          f"{'in them s':>10} {'between s':>10} {'stalled s':>10}")
    for mode, m in medians.items():
        print(f"{mode:<10} {m['seconds']:>9.2f} {m['generation_s']:>13.2f} {m['tokens']:>9,.0f} "
              f"{m['tokens_per_s']:>10,.1f} {m['forwards']:>9,.0f} {m['forward_s']:>10.2f} "
              f"{m['between_forwards_s']:>10.2f} {m['pinned_wait_s']:>10.2f}")
    print(f"one pass / two passes: {result['one_pass_vs_two_pass']:.3f}x the speed; "
          f"one pass / generation alone: {result['one_pass_vs_generation_alone']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
