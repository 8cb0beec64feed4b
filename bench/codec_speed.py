"""The codec alone: how fast `dataset.codec.Codec.encode` compresses hidden states, by codec, Blosc2 threads per
call and writer threads calling it at once (as the shard writers do), and the ratio it reaches.

    python bench/codec_speed.py                          # random normal bf16 states, 4096 wide
    python bench/codec_speed.py --dataset work/dataset   # the states of a written dataset (its first shard)

Prints one line per setting: GB/s of uncompressed states taken in (all writer threads together), and the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle_states.dataset.codec import Codec


def states_of(dataset: Path | None, tokens: int, hidden: int) -> list[torch.Tensor]:
    """Tensors of [T, H] like the writers get: a dataset's hidden states, or random normal bf16."""
    if dataset is None:
        torch.manual_seed(0)
        return [torch.randn(tokens // 8, hidden).bfloat16() for _ in range(8)]
    from eagle_states.dataset.layout import parse_key
    from eagle_states.dataset.shard_file import ShardReader

    shard = sorted((Path(dataset) / "shards").glob("*.safetensors"))[0]
    with ShardReader(shard) as f:
        return [f.get_tensor(k) for k in f.keys() if parse_key(k) and parse_key(k).field == "hidden_states"]


def measure(states: list[torch.Tensor], codec: Codec, writers: int, repeat: int) -> tuple[float, float]:
    """(GB/s taken in by `writers` threads encoding at once, compression ratio)."""
    raw = sum(t.nbytes for t in states)
    stored = sum(len(codec.encode([t], t.element_size())) for t in states)  # also warms the library up
    jobs = [t for _ in range(repeat * writers) for t in states]
    with ThreadPoolExecutor(writers) as pool:
        started = time.perf_counter()
        list(pool.map(lambda t: codec.encode([t], t.element_size()), jobs))
        elapsed = time.perf_counter() - started
    return raw * repeat * writers / elapsed / 1e9, raw / stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, help="a written dataset (default: random normal bf16 states)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--codecs", default="blosc2-zstd,blosc2-lz4")
    parser.add_argument("--threads", default="1,2,4", help="Blosc2 threads per call")
    parser.add_argument("--writers", default="1,4", help="threads calling the codec at once")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    states = states_of(args.dataset, args.tokens, args.hidden)
    print(f"{sum(t.nbytes for t in states) / 1e6:,.0f} MB of {states[0].dtype} states, width {states[0].shape[-1]}")
    for name, threads, writers in itertools.product(args.codecs.split(","), map(int, args.threads.split(",")),
                                                    map(int, args.writers.split(","))):
        speed, ratio = measure(states, Codec(name, 1, threads), writers, args.repeat)
        print(f"{name:12s} {threads} threads x {writers} writers: {speed:6.2f} GB/s in, ratio {ratio:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
