"""Extraction speed side by side in one run: plain prefill, this project's extraction (and its export to the
`speculators` layout a trainer reads), and the peer's, speculators' data-generation path (vLLM's
`extract_hidden_states` with the hidden-states connector, bench/peer_extract.py) on the same token ids; model load
excluded from each. Random prompts of one length, as `eagle-states bench` uses.

    python bench/peer_speed.py MODEL OUT --prompts 128 --prompt-len 2048 --layer-ids 2,16,29,32 --dtype bfloat16

Prints one JSON line. Ours writes shards (fsynced), receipts, an index and a manifest, and the export then writes
one file a sample; the peer writes one safetensors file a sample (its connector's thread pool) and nothing else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--write-threads", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()

    from acceptance import peer_export

    from eagle_states.bench import random_prompts, write_prompts
    from eagle_states.capture.engine import EngineHolder
    from eagle_states.config import PipelineParams
    from eagle_states.export import export_dataset
    from eagle_states.extraction.driver import Extraction, run_extraction
    from eagle_states.validate import validate_dataset

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    layer_ids = [int(k) for k in args.layer_ids.split(",")]
    prompts = random_prompts(Path(args.model), args.prompts, args.prompt_len)
    source = out / "prompts.jsonl"
    write_prompts(source, prompts)
    tokens = args.prompts * args.prompt_len
    params = PipelineParams.model_validate({
        "model": {"path": args.model, "build_demo_if_missing": False},
        "extract": {"input": str(source), "dtype": args.dtype, "layer_ids": layer_ids,
                    "max_model_len": args.prompt_len + 16, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_num_seqs": 64, "shard_max_tokens": 32768, "write_threads": args.write_threads},
        "output": {"dir": str(out / "dataset"), "prefect_results": str(out / "results")}})
    extraction = Extraction(params)
    engines = EngineHolder()
    engine = engines(extraction.engine_settings())  # loaded before any clock starts, as the peer's
    engine.plain_prefill(prompts[:8])  # warm-up
    started = time.monotonic()
    engine.plain_prefill(prompts)
    plain_s = time.monotonic() - started
    started = time.monotonic()
    run_extraction(extraction, progress=False, engines=engines)
    ours_s = time.monotonic() - started
    engines.close()  # and torch's cache of it handed back: the peer's engine wants the device free at start
    started = time.monotonic()
    assert validate_dataset(out / "dataset", report=out / "validation.json").valid  # export takes valid datasets
    validate_s = time.monotonic() - started
    started = time.monotonic()
    export_dataset(out / "dataset", out / "export", "speculators", progress=False)
    export_s = time.monotonic() - started
    shutil.rmtree(out / "dataset")  # room for the peer's copy
    peer = peer_export(Path(args.model), out / "export", out / "peer", layer_ids, args.dtype)
    result = {"model": args.model, "tokens": tokens, "layer_ids": layer_ids, "dtype": args.dtype,
              "seconds": {"plain prefill": round(plain_s, 2), "eagle-states extract": round(ours_s, 2),
                          "eagle-states validate": round(validate_s, 2), "eagle-states export": round(export_s, 2),
                          "speculators (peer)": peer["seconds"]},
              "tokens_per_s": {"plain prefill": round(tokens / plain_s), "eagle-states extract": round(tokens / ours_s),
                               "eagle-states extract + export": round(tokens / (ours_s + export_s)),
                               "speculators (peer)": round(tokens / peer["seconds"])},
              "peer_states_bitwise_equal_to_ours": f"{peer['bitwise_equal_to_ours']} of {peer['samples']}"}
    result["ratio_to_plain"] = {k: round(v / result["tokens_per_s"]["plain prefill"], 3)
                                for k, v in result["tokens_per_s"].items()}
    print(json.dumps(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
