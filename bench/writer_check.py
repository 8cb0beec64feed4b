"""The shard writer against the disk alone, side by side: shards of plain bf16 states written through
`ShardFileWriter` (header, key order, the stream hashed beside the writes, O_DIRECT) by 1 and 3 threads at once,
against the same bytes written through `atomic_file` as the bench's disk probe writes them. Nothing of the capture
runs: what is left between the two is the writer's own cost (#29: on the H200 the capture's writers took 1.26 of
the disk's 1.92 GB/s on the Llama-8B shape).

    python3 bench/writer_check.py DIR [--hidden 4096] [--samples 8] [--rounds 2]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from disk_check import measure  # noqa: E402  (this script's directory is on the path)
from eagle_states.bench import write_like_a_shard  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8, help="samples of 2,048 tokens a shard")
    parser.add_argument("--rounds", type=int, default=2)
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


if __name__ == "__main__":
    main()
