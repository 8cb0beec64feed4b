"""Does nvcomp-ans slow the model's forward passes by holding the GIL? (#29: while it encodes, the forward passes
took 2.1 x their device time, from the forward thread or from the assembler thread alike.)

Two parts. The probe times each nvCOMP call from the host (`as_arrays`, `encode`, `buffer_sizes`, letting go of
the arrays, `NvcompStepEncoder` whole) with a 1-ms ticker thread beside it: the ticker's longest gap during a call
is how long that call held the GIL. Each call runs with the device idle, then behind 50 ms of device work queued on
its own stream, then on another: a call that waits for the device grows by those 50 ms.

Then the capture's pattern: a "forward" thread launches steps of small kernels (each launch needs the GIL) and hands
each step's event to an "encoder" thread, which encodes a captured-step-sized [L, R, H] bf16 tensor once per step,
in three ways: not at all; after `stream.wait_event(step)` (the capture before this check: nvCOMP's calls wait
behind the step's kernels); after `step.synchronize()` on the host (torch lets go of the GIL while it waits; the
capture now). Prints the forward thread's launches per second against alone; they should not fall.

    python3 bench/nvcomp_gil_check.py [--seconds 5] [--layers 4] [--rows 16384] [--hidden 7168]
"""

import argparse
import json
import queue
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_states.dataset.step_codecs import NvcompStepEncoder, nvcomp_module  # noqa: E402

LAUNCHES_PER_ITER = 3  # matmul, scale, tanh


class Ticker:
    """A thread that wakes every millisecond; its longest gap in a window is the longest the GIL was held."""

    def __init__(self):
        self.last, self.gap, self.ticks, self.stop = time.monotonic(), 0.0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            self.gap, self.last, self.ticks = max(self.gap, now - self.last), now, self.ticks + 1

    def window(self, call):
        time.sleep(0.01)
        self.gap = 0.0
        started = time.monotonic()
        result = call()
        took = time.monotonic() - started
        time.sleep(0.005)  # the gap ends when the ticker runs again
        return result, took, self.gap


def probe(stacked: torch.Tensor) -> list[dict]:
    """Each nvCOMP call timed with 50 ms of device work queued first on its own stream, then on another one (the
    model's, in the capture): a call that waits for the device holds the GIL for those 50 ms (a device-wide wait,
    such as cudaFree's, shows on the other stream too)."""
    nvcomp = nvcomp_module()
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    layers, rows, width = stacked.shape
    nbytes = rows * width * 2
    flat = stacked.reshape(-1).view(torch.float16)
    codec = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=stream.cuda_stream)
    out_buffer = torch.empty(2 * layers * nbytes, dtype=torch.uint8, device="cuda")
    ticker, rows_out = Ticker(), []

    def arrays():
        return (nvcomp.as_arrays(flat, [i * nbytes for i in range(layers)], [nbytes] * layers,
                                 cuda_stream=stream.cuda_stream),
                nvcomp.as_arrays(out_buffer, [i * 2 * nbytes for i in range(layers)], [2 * nbytes] * layers,
                                 cuda_stream=stream.cuda_stream))

    def queue_work(on):
        with torch.cuda.stream(on):
            torch.cuda._sleep(int(50e-3 * 1.98e9))  # about 50 ms at the H200's clock

    for queued_on in ("none", "none", "own", "other"):  # the first is the warm-up
        torch.cuda.synchronize()
        timings = {}

        def timed(name, call, queued_on=queued_on):
            if queued_on != "none":
                torch.cuda.synchronize()
                queue_work(stream if queued_on == "own" else other)
            result, took, gap = ticker.window(call)
            timings[f"{name}_ms"], timings[f"{name}_gil_ms"] = round(took * 1e3, 2), round(gap * 1e3, 2)
            return result

        held = list(timed("as_arrays", arrays))  # [src, out]: the list's clear() is the only release
        with torch.cuda.stream(stream):
            timed("encode", lambda: codec.encode(held[0], out=held[1]))
        torch.cuda.synchronize()
        timed("buffer_sizes", lambda: held[1].buffer_sizes)
        timed("free_arrays", held.clear)
        encoder = NvcompStepEncoder(stream)
        timed("step_encoder", lambda: encoder(stacked, [(0, rows)]))
        rows_out.append({"queued_on": queued_on, **timings})
    ticker.stop.set()
    return rows_out[1:]


def forward_thread(stop: threading.Event, steps: queue.Queue | None, counts: list) -> None:
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    launches, previous = 0, None
    while not stop.is_set():
        for _ in range(200):
            x = torch.tanh(x @ w * 0.03)
        launches += 200 * LAUNCHES_PER_ITER
        step = torch.cuda.Event()
        step.record()
        if steps is not None and steps.empty():
            steps.put(step)
        if previous is not None:
            previous.synchronize()  # as vLLM waits for a step's sampled tokens, one step behind
        previous = step
    counts.append(launches)


def run(mode: str, seconds: float, stacked: torch.Tensor) -> dict:
    encoder = NvcompStepEncoder(torch.cuda.Stream())
    spans = [(0, stacked.shape[1])]
    if mode != "alone":
        encoder(stacked, spans)  # warm-up: nvCOMP's scratch and kernels
    torch.cuda.synchronize()
    stop, counts, encodes = threading.Event(), [], [0]
    steps = None if mode == "alone" else queue.Queue()

    def encoder_thread():
        while not stop.is_set():
            try:
                step = steps.get(timeout=0.1)
            except queue.Empty:
                continue
            if mode == "after-host-wait":
                step.synchronize()
            else:
                encoder.stream.wait_event(step)
            with torch.cuda.stream(encoder.stream):
                encoder(stacked, spans)
            encodes[0] += 1

    threads = [threading.Thread(target=forward_thread, args=(stop, steps, counts))]
    if steps is not None:
        threads.append(threading.Thread(target=encoder_thread))
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    return {"mode": mode, "forward_launches_per_s": round(counts[0] / elapsed),
            "encodes_per_s": round(encodes[0] / elapsed, 1),
            "encoder_GB_per_s": round(encodes[0] * stacked.numel() * 2 / elapsed / 1e9, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=7168)
    args = ap.parse_args()
    nvcomp_module()
    stacked = (torch.randn(args.layers, args.rows, args.hidden, device="cuda") * 3).to(torch.bfloat16)
    for row in probe(stacked):
        print(json.dumps(row))
    rows = [run(mode, args.seconds, stacked)
            for mode in ("alone", "after-wait-event", "after-host-wait", "alone")]
    for row in rows:
        print(json.dumps(row))
    alone = min(r["forward_launches_per_s"] for r in rows if r["mode"] == "alone")
    for row in rows[1:3]:
        print(f"{row['mode']}: forward launches {row['forward_launches_per_s'] / alone:.2f} x alone, "
              f"{row['encodes_per_s']} encodes/s, encoder {row['encoder_GB_per_s']} GB/s")


if __name__ == "__main__":
    main()
