"""Engine workers against the flow run's own engine, measured side by side in one run on one machine: the same
prompts and shards computed (a) by an engine in this process, (b) by one engine worker fed through a real Prefect
server, (c) by two workers, (d) by one worker again (a-b-c-d, so a drift of the machine shows). Each engine owns
one core (CPU build) or one GPU. The in-process round includes writing the index and manifest (milliseconds). Prints tokens/s of each, the ratio of two workers to one, and the dispatch
overhead per shard (what one worker adds over the in-process engine, per shard).

    python3 bench/engine_workers.py WORKDIR [--shards 16] [--shard-tokens 2048] [--hidden 512] [--layers 8]
    python3 bench/engine_workers.py WORKDIR --model /dev/shm/m8b --dtype bfloat16 --shards 80 --shard-tokens 32768 \
        --batch-tokens 16384 --gpu-memory-utilization 0.4 --max-workers 1          # one GPU
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import prefect_server, random_prompts, stop, write_prompt_jsonl  # noqa: E402

from eagle_states.capture.engine import EngineHolder  # noqa: E402
from eagle_states.config import PipelineParams  # noqa: E402
from eagle_states.demo import make_demo_model  # noqa: E402
from eagle_states.bench import free_disk_blocks  # noqa: E402
from eagle_states.dataset.layout import shard_path  # noqa: E402
from eagle_states.extraction.driver import Extraction  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", help="an existing model directory (default: a demo model of --hidden/--layers)")
    parser.add_argument("--batch-tokens", type=int, help="max_num_batched_tokens (default: half a shard)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    parser.add_argument("--max-workers", type=int, default=2, help="1 on a one-GPU machine")
    parser.add_argument("--worker-limit", type=int, default=3, help="shard tasks a worker runs at once (--limit)")
    parser.add_argument("--free-written", action="store_true", help="free each shard's disk blocks once it is "
                        "recorded (the file keeps its size), for rounds larger than the disk")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else make_demo_model(
        work / "model", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.hidden // 64)
    prompt_len = min(args.shard_tokens // 4, 2048)
    per_shard = args.shard_tokens // prompt_len
    source = write_prompt_jsonl(work / "prompts.jsonl",
                                random_prompts([prompt_len] * (per_shard * args.shards), 500, seed=3))
    base = {"model": {"path": str(model), "build_demo_if_missing": False},
            "prepare": {"max_length": prompt_len},
            "extract": {"input": str(source), "dtype": args.dtype, "shard_max_tokens": args.shard_tokens,
                        "max_num_batched_tokens": args.batch_tokens or args.shard_tokens // 2,
                        "max_model_len": prompt_len + 16, "gpu_memory_utilization": args.gpu_memory_utilization},
            "output": {"dir": str(work / "unused"), "prefect_results": str(work / "results")}}
    tokens = per_shard * args.shards * prompt_len

    def params(out: str) -> PipelineParams:
        return PipelineParams.model_validate({**base, "output": {**base["output"], "dir": str(work / out)}})

    results = {}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    holder = EngineHolder()
    holder(Extraction(params("warm")).engine_settings())  # loaded before the clock starts
    freeing = ThreadPoolExecutor(max_workers=1)

    def free(out: Path, shard: str):
        if args.free_written:
            freeing.submit(free_disk_blocks, shard_path(out, shard))

    started = time.monotonic()
    Extraction(params("in-process")).run(holder, lambda shard, cached: free(work / "in-process", shard.name))
    results["in_process_s"] = time.monotonic() - started
    holder.close()

    with prefect_server(work / "server") as env:
        os.environ["PREFECT_API_URL"] = env["PREFECT_API_URL"]
        from eagle_states.coordination.dispatch import dispatch, serving_workers  # noqa: E402  (after the API is set)

        key = Extraction(params("warm")).serving_key
        (work / "worker.yaml").write_text(yaml.safe_dump(params("worker").model_dump(mode="json", by_alias=True)))
        workers = []

        def start(core: int):
            log = open(work / f"worker-{core}.log", "w")
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "eagle_states", "engine-worker", "--params", str(work / "worker.yaml"),
                 "--limit", str(args.worker_limit)],
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(core), "CUDA_VISIBLE_DEVICES": str(core),
                     "PYTHONPATH": os.pathsep.join(sys.path)},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            while len(serving_workers(key)) < len(workers):
                time.sleep(1)

        def timed(name: str) -> None:
            extraction = Extraction(params(name))
            started = time.monotonic()
            dispatch(extraction, extraction.params, lambda outcome: free(work / name, outcome.shard))
            results[f"{name}_s"] = time.monotonic() - started

        try:
            start(0)
            timed("one_worker")
            if args.max_workers > 1:
                start(1)
                timed("two_workers")
                stop(workers.pop())
                while len(serving_workers(key)) > 1:
                    time.sleep(0.5)
            timed("one_worker_again")
        finally:
            for proc in workers:
                stop(proc)
    rounds = [name for name in ("in-process", "one_worker", "two_workers", "one_worker_again")
              if name == "in-process" or f"{name}_s" in results]
    shas = {name: [json.loads(p.read_text())["blake3"] for p in sorted((work / name / "receipts").glob("*.json"))]
            for name in rounds}  # the receipts' hashes, taken as each shard was written (--free-written empties them)
    one = (results["one_worker_s"] + results["one_worker_again_s"]) / 2
    summary = {**results, "worker_limit": args.worker_limit, "shards": args.shards, "tokens": tokens, "shard_tokens": args.shard_tokens,
               "in_process_tok_s": tokens / results["in_process_s"], "one_worker_tok_s": tokens / one,
               "one_worker_over_in_process": results["in_process_s"] / one,
               "dispatch_overhead_per_shard_s": (one - results["in_process_s"]) / args.shards,
               "identical_bytes": all(v == shas["in-process"] for v in shas.values())}
    print(f"in-process engine   {summary['in_process_tok_s']:,.0f} tokens/s ({results['in_process_s']:.1f} s)")
    print(f"one engine worker   {summary['one_worker_tok_s']:,.0f} tokens/s ({results['one_worker_s']:.1f} s, "
          f"again {results['one_worker_again_s']:.1f} s): {summary['one_worker_over_in_process']:.3f} x in-process")
    if "two_workers_s" in results:
        summary.update(two_workers_tok_s=tokens / results["two_workers_s"], two_over_one=one / results["two_workers_s"])
        print(f"two engine workers  {summary['two_workers_tok_s']:,.0f} tokens/s ({results['two_workers_s']:.1f} s)")
        print(f"two / one workers   {summary['two_over_one']:.2f} x")
    print(f"dispatch overhead   {summary['dispatch_overhead_per_shard_s']:.2f} s per shard (one worker against "
          f"the in-process engine, {args.shards} shards of {args.shard_tokens} tokens)")
    print(f"identical shards    {summary['identical_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
