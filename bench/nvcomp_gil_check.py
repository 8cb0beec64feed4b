"""Does nvcomp-ans slow the model's forward passes by holding the GIL? (#29: while it encodes, the forward passes
took 2.1 x their device time, from the forward thread or from the assembler thread alike.)

A "forward" thread launches small kernels one at a time, as vLLM's eager forward pass does (each launch needs the
GIL); an "encoder" thread encodes a captured-step-sized [L, R, H] bf16 tensor in a loop on its own stream, in
three ways: not at all, waiting for nvCOMP's output sizes in nvCOMP's `buffer_sizes` (the capture before this
check), and waiting through a torch CUDA event first (`NvcompStepEncoder` now). Prints the forward thread's
launches per second and the encoder's GB/s in each; the forward's rate should not fall with the encoder on.

    python3 bench/nvcomp_gil_check.py [--seconds 5] [--layers 4] [--rows 16384] [--hidden 7168]
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_states.dataset.step_codecs import NvcompStepEncoder, nvcomp_module  # noqa: E402


def forward_thread(stop: threading.Event, counts: list) -> None:
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    launches = 0
    while not stop.is_set():
        for _ in range(200):
            x = torch.tanh(x @ w * 0.03)
        launches += 600  # matmul, scale, tanh
        torch.cuda.current_stream().synchronize()  # as a step ends (and lets go of the GIL)
    counts.append(launches)


def sizes_from_nvcomp(encoder: NvcompStepEncoder, stacked: torch.Tensor, spans) -> None:
    """The capture's encode before this check: nvCOMP's own wait for the output sizes."""
    nvcomp = encoder.nvcomp
    if "<f2" not in encoder.codecs:
        encoder.codecs["<f2"] = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=encoder.stream.cuda_stream)
    codec = encoder.codecs["<f2"]
    layers, rows, width = stacked.shape
    flat = stacked.reshape(-1).view(torch.float16)
    nbytes = rows * width * 2
    if encoder.out.numel() < 2 * layers * nbytes:
        encoder.out = torch.empty(2 * layers * nbytes, dtype=torch.uint8, device="cuda")
    out = nvcomp.as_arrays(encoder.out, [i * 2 * nbytes for i in range(layers)], [2 * nbytes] * layers,
                           cuda_stream=encoder.stream.cuda_stream)
    codec.encode(nvcomp.as_arrays(flat, [i * nbytes for i in range(layers)], [nbytes] * layers,
                                  cuda_stream=encoder.stream.cuda_stream), out=out)
    out.buffer_sizes  # noqa: B018 (the wait itself is what is measured)


def run(mode: str, seconds: float, stacked: torch.Tensor) -> dict:
    encoder = NvcompStepEncoder(torch.cuda.Stream())
    spans = [(0, stacked.shape[1])]
    encode = {"nvcomp-wait": lambda: sizes_from_nvcomp(encoder, stacked, spans),
              "torch-event-wait": lambda: encoder(stacked, spans)}.get(mode)
    if encode:
        encode()  # warm-up: nvCOMP's scratch and kernels
    torch.cuda.synchronize()
    stop, counts, encodes = threading.Event(), [], [0]

    def encoder_thread():
        with torch.cuda.stream(encoder.stream):
            while not stop.is_set():
                encode()
                encodes[0] += 1

    threads = [threading.Thread(target=forward_thread, args=(stop, counts))]
    if encode:
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
    rows = [run(mode, args.seconds, stacked) for mode in ("alone", "nvcomp-wait", "torch-event-wait", "alone")]
    for row in rows:
        print(json.dumps(row))
    alone = min(r["forward_launches_per_s"] for r in rows if r["mode"] == "alone")
    for row in rows[1:3]:
        print(f"{row['mode']}: forward launches {row['forward_launches_per_s'] / alone:.2f} x alone, "
              f"encoder {row['encoder_GB_per_s']} GB/s")


if __name__ == "__main__":
    main()
