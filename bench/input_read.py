"""The extraction input read, checked and planned into shards (`Extraction`'s start, before the first forward
pass: on the critical path of every run), in both forms side by side: a JSONL of token ids and a prepared
directory's samples table. Prints the time (median of 5) and the host memory the samples hold.

    python bench/input_read.py [--prompts 384] [--prompt-len 2048] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from eagle_states.bench import write_prompts
from eagle_states.dataset.prepared import input_hash, load_input
from eagle_states.extraction.driver import plan_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, table = Path(tmp) / "prompts.jsonl", Path(tmp) / "prepared"
        jsonl.write_text("".join(json.dumps({"id": f"b{i:06d}", "source_row": i + 1, "input_ids": p,
                                             "loss_mask": [1] * len(p)}) + "\n" for i, p in enumerate(prompts)))
        write_prompts(table, prompts)
        hashes = set()
        for name, path in (("JSONL of token ids", jsonl), ("prepared samples table", table)):
            times = []
            for _ in range(5):
                gc.collect()
                started = time.perf_counter()
                samples = load_input(path, args.vocab, args.prompt_len + 1)
                plan_shards(samples, 32768)
                times.append(time.perf_counter() - started)
                del samples
            gc.collect()
            tracemalloc.start()
            samples = load_input(path, args.vocab, args.prompt_len + 1)
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            hashes.add(input_hash(samples))
            print(f"{name:24s} {args.prompts * args.prompt_len:,} tokens: read, checked and planned in "
                  f"{statistics.median(times) * 1e3:6.1f} ms, the samples hold {held / 1e6:5.1f} MB "
                  f"({held / (args.prompts * args.prompt_len):.1f} bytes a token)")
        print("the same samples from both:", len(hashes) == 1)


if __name__ == "__main__":
    main()
