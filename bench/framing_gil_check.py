"""How long the shard writer's framing of a step codec's tensor holds the GIL (#29: at the DeepSeek-V3 width,
nvcomp-ans and fp8-e4m3 slowed the model's forward passes, which vLLM launches kernel by kernel from one Python
thread; 8 writer threads frame each step's tensors beside it). Runs on the CPU build: framing is host work.

One sample's tensor of one layer slot at the DeepSeek-V3 width in three pieces (as a sample split over three
engine steps), framed as fp8-e4m3 and as nvcomp-ans (random bytes of nvcomp-ans's ratio: framing does not look
at them), each call timed beside a 1-ms ticker thread: its longest gap is the longest the call held the GIL at
once, and its rate during the call against its rate idle is the share of the call the GIL was free.

    python bench/framing_gil_check.py [--rows 16384] [--hidden 7168] [--repeats 5]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nvcomp_gil_check import Ticker  # noqa: E402  (bench/ is this script's directory)

from eagle_states.dataset.step_codecs import FP8_AUX, Fp8Piece, NvcompPiece, frame  # noqa: E402


def pieces(rows: int, hidden: int) -> dict[str, list]:
    cuts = [0, rows // 3, rows // 3 + 1, rows]  # a piece of a single row, as a chunked prefill can leave
    codes = torch.randint(0, 256, (rows, hidden), dtype=torch.uint8)
    aux = torch.rand(rows, FP8_AUX)
    blob_bytes = int(hidden * 2 / 1.452)  # a row's share of an nvCOMP buffer at its ratio on captured states
    return {
        "fp8-e4m3": [Fp8Piece(codes[a:b], aux[a:b], torch.bfloat16) for a, b in zip(cuts, cuts[1:])],
        "nvcomp-ans": [NvcompPiece(torch.randint(0, 256, ((b - a) * blob_bytes,), dtype=torch.uint8), b - a, hidden,
                                   torch.bfloat16) for a, b in zip(cuts, cuts[1:])],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ticker = Ticker()
    ticks, started = ticker.ticks, time.monotonic()
    time.sleep(1)
    idle_rate = (ticker.ticks - ticks) / (time.monotonic() - started)
    for codec in ("fp8-e4m3", "nvcomp-ans"):
        tensor = pieces(args.rows, args.hidden)[codec]
        frame(codec, tensor)  # warm-up
        calls, gaps, free, stored = [], [], [], 0
        for _ in range(args.repeats):
            ticks = ticker.ticks
            (blob, _), took, gap = ticker.window(lambda: frame(codec, tensor))
            calls.append(took)
            gaps.append(gap)
            free.append(min(1.0, (ticker.ticks - ticks) / (took + 0.015) / idle_rate))  # the window's sleeps too
            stored = len(blob)
        print(json.dumps({"codec": codec, "stored_MB": round(stored / 1e6, 1),
                          "call_ms": round(statistics.median(calls) * 1e3, 1),
                          "longest_gil_hold_ms": round(statistics.median(gaps) * 1e3, 1),
                          "gil_free_share": round(statistics.median(free), 2)}))
    ticker.stop.set()


if __name__ == "__main__":
    main()
