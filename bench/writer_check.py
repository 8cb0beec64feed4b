"""The shard writer against the disk alone, side by side: shards of plain bf16 states written through
`ShardFileWriter` (header, key order, the stream hashed beside the writes, O_DIRECT) by 1 and 3 threads at once,
against the same bytes written through `atomic_file` as the bench's disk probe writes them. Nothing of the capture
runs: what is left between the two is the writer's own cost (#29: on the H200 the capture's writers took 1.26 of
the disk's 1.92 GB/s on the Llama-8B shape).

Then one shard of a step codec (nvcomp-ans: random bytes at its ratio, framing does not look at them; or
fp8-e4m3) written as the capture's writer writes one, its samples' states framed one at a time and all four at
once, side by side: how long the shard of the run's last step takes to reach the disk once its samples are
captured.

Then one sample of `--spill-tokens` written as its shard's writer writes it, held in memory and spilled (its steps
added to a spill file, then its states streamed back from it to the shard and once more for a compressed shard's
digest, `capture.spill`), side by side, uncompressed, with Blosc2 (compressed as it is read back) and with the
`--framed` codec: what spilling costs the writer beside what it costs the disk (the seventeenth session's spilled
nvcomp-ans shards took 18.5 s a writer on the H200, 13.5 of them outside hashing and waiting for writes).

    python3 bench/writer_check.py DIR [--hidden 4096] [--samples 8] [--rounds 2] [--framed nvcomp-ans|fp8-e4m3]
                                      [--spill-tokens 16384]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from disk_check import measure  # noqa: E402  (this script's directory is on the path)
from framing_gil_check import pieces as framing_pieces  # noqa: E402
from eagle_states.bench import write_like_a_shard  # noqa: E402
from eagle_states.capture.spill import spill_file  # noqa: E402
from eagle_states.dataset.codec import Codec  # noqa: E402
from eagle_states.dataset.layout import key_hidden_state  # noqa: E402
from eagle_states.dataset.shard_file import ShardFileWriter, sample_tensor_specs  # noqa: E402

TOKENS, STATES = 2048, 4


def write_shard(path: Path, samples: int, state: torch.Tensor) -> None:
    """A shard of `samples` samples of 2,048 tokens, each state `state`, as the capture's writer writes one."""
    specs = {}
    for s in range(samples):
        specs.update(sample_tensor_specs(f"s{s:03d}", TOKENS, STATES, state.shape[1], state.dtype))
    with ShardFileWriter(path, specs) as out:
        for name in out.order:
            dtype, shape = specs[name]
            out.write(name, [state] if dtype == state.dtype else [torch.zeros(shape, dtype=dtype)])


def write_framed_shard(path: Path, samples: int, hidden: int, codec: Codec, state: list,
                       encode_threads: int) -> None:
    """A shard of `samples` samples of 2,048 tokens, each state `state` (a step codec's pieces), written a sample at
    a time (`ShardFileWriter.write_many`) with `encode_threads` framing threads."""
    specs = {}
    for s in range(samples):
        specs.update(sample_tensor_specs(f"s{s:03d}", TOKENS, STATES, hidden, torch.bfloat16))
    with ShardFileWriter(path, specs, codec, encode_threads) as out:
        for s in range(samples):
            out.write_many({name: state if dtype == torch.bfloat16 else [torch.zeros(shape, dtype=dtype)]
                            for name in out.order if name.startswith(f"s{s:03d}/")
                            for dtype, shape in [specs[name]]})


def write_spilled_sample(path: Path, tokens: int, hidden: int, codec: Codec, step: list,
                         spill: bool) -> tuple[float, float]:
    """A shard of one sample of `tokens` rows whose every state is `step` (a step's pieces, of TOKENS rows) again
    and again, as the capture's shard writer writes it: held in memory, or spilled first. Returns (seconds spilling,
    seconds writing the shard)."""
    specs = sample_tensor_specs("s", tokens, STATES, hidden, torch.bfloat16)
    slots = {key_hidden_state("s", slot): slot for slot in range(STATES)}
    started, spilled = time.perf_counter(), None
    if spill:
        spilled = spill_file(str(path), tokens, codec)
        for first in range(0, tokens, TOKENS):
            row = first
            for piece in step:
                spilled.add(row, [piece] * STATES)
                row += piece.rows if codec.on_device else piece.shape[0]
    spilling, started = time.perf_counter() - started, time.perf_counter()
    try:
        with ShardFileWriter(path, specs, codec) as out:
            for name in out.order:
                if name not in slots:
                    out.write(name, [torch.zeros(specs[name][1], dtype=specs[name][0])])
                elif spilled is not None:
                    out.write_streamed(name, spilled.stream(slots[name]))
                else:
                    out.write(name, step * (tokens // TOKENS))
    finally:
        if spilled is not None:
            spilled.close()
    return spilling, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8, help="samples of 2,048 tokens a shard")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--framed", choices=["nvcomp-ans", "fp8-e4m3"], default="nvcomp-ans")
    parser.add_argument("--spill-tokens", type=int, default=16384, help="the spilled sample's tokens (of 2,048 a step)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    state = torch.randn(TOKENS, args.hidden).to(torch.bfloat16)
    nbytes = args.samples * TOKENS * args.hidden * state.element_size() * STATES
    for _ in range(args.rounds):
        for threads in (1, 3):
            writer = measure(lambda path, total, block: write_shard(path, args.samples, state), args.dir,
                             threads * nbytes, threads)
            alone = measure(write_like_a_shard, args.dir, threads * nbytes, threads)
            print(f"WRITER {threads} shard(s) at once: ShardFileWriter {writer:.2f} GB/s, the disk alone {alone:.2f} "
                  f"GB/s ({writer / alone:.2f} x)", flush=True)
    codec, state = Codec(args.framed), framing_pieces(TOKENS, args.hidden)[args.framed]
    captured = args.samples * TOKENS * args.hidden * 2 * STATES
    for _ in range(args.rounds):
        took = {}
        for threads in (1, STATES):
            path = args.dir / "framed.safetensors"
            started = time.perf_counter()
            write_framed_shard(path, args.samples, args.hidden, codec, state, threads)
            took[threads] = time.perf_counter() - started
            path.unlink()
        print(f"FRAMED one {args.framed} shard of {captured / 1e9:.2f} GB captured: the states framed one at a "
              f"time {took[1]:.3f} s, a sample's {STATES} at once {took[STATES]:.3f} s ({took[1] / took[STATES]:.2f} "
              "x)", flush=True)
    plain = [torch.randn(TOKENS, args.hidden).to(torch.bfloat16)]
    steps = {"none": plain, "blosc2-zstd": plain, args.framed: framing_pieces(TOKENS, args.hidden)[args.framed]}
    tokens = args.spill_tokens // TOKENS * TOKENS
    for _ in range(args.rounds):
        for name, step in steps.items():
            path = args.dir / "spilled.safetensors"
            _, held = write_spilled_sample(path, tokens, args.hidden, Codec(name), step, spill=False)
            spilling, streamed = write_spilled_sample(path, tokens, args.hidden, Codec(name), step, spill=True)
            stored = path.stat().st_size
            path.unlink()
            print(f"SPILLED {name}: one sample of {tokens:,} tokens, {stored / 1e9:.2f} GB stored: written held in "
                  f"memory {held:.3f} s, spilled {spilling:.3f} s then written from its file {streamed:.3f} s "
                  f"({streamed / held:.2f} x held)", flush=True)


if __name__ == "__main__":
    main()
