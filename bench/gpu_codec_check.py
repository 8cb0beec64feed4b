"""The step codecs on a CUDA device, without an engine: what the capture does to a step, then what a shard stores
and what `ShardReader` gives back.

* nvcomp-ans: a step of [L, R, H] states in spans (as samples split it), encoded on the device, copied, framed,
  written and read back bit for bit; its ratio and its own speed (device time, CUDA events) on the step.
* fp8-e4m3: the codes and scales made on the GPU (compiled, as the capture makes them there, and eager, as the CPU
  build does) against the ones the CPU makes from the same states, its read back within the bound, and the speed
  of both side by side.
* fp8-e4m3-ans: the same step as fp8-e4m3 with its codes coded by ANS: read back bit for bit as fp8-e4m3's; its
  ratio and speed (fp8 and ANS together).

    python3 bench/gpu_codec_check.py [--hidden 7168] [--rows 16384] [--layers 4] [--states FILE.safetensors]
`--states`: real captured states (a shard of a plain dataset) instead of random ones: a random state has no
structure for ANS to find but the exponents' skew, which the residual stream also has. Exits 1 on a mismatch.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_states.dataset.codec import Codec  # noqa: E402
from eagle_states.dataset.shard_file import ShardFileWriter, ShardReader, sample_tensor_specs  # noqa: E402
from eagle_states.dataset.step_codecs import NvcompStepEncoder, fp8_ans_encode_step, fp8_encode_step  # noqa: E402


def device_seconds(fn, repeat=3):
    out = fn()  # warm-up (nvCOMP's scratch, kernels)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3 / repeat


def roundtrip(codec: Codec, step, stacked, spans, workdir: Path, like: Path | None = None) -> tuple[int, bool]:
    """Write the step's spans as samples of a shard (the writer's path), read them back; (stored bytes, equal):
    bit for bit as `stacked` (lossless), within the bound (lossy), or bit for bit as the shard `like` reads."""
    host = step.data.cpu()
    rows = step.host_rows(host, codec.name)
    layers, _, width = stacked.shape
    specs = {}
    for i, (start, stop) in enumerate(spans):
        specs.update(sample_tensor_specs(f"s{i}", stop - start, layers, width, stacked.dtype))
    path = workdir / f"{codec.name}.safetensors"
    with ShardFileWriter(path, specs, codec) as out:
        for name in out.order:
            sample, field = name.split("/", 1)
            start, stop = spans[int(sample[1:])]
            if field == "input_ids":
                out.write(name, [torch.zeros(stop - start, dtype=torch.int32)])
            elif field == "loss_mask":
                out.write(name, [torch.ones(stop - start, dtype=torch.uint8)])
            else:
                out.write(name, [rows[int(field.rsplit("/", 1)[1])][start:stop]])
    equal = True
    with ShardReader(path) as shard:
        for i, (start, stop) in enumerate(spans):
            for slot in range(layers):
                got = shard.get_tensor(f"s{i}/hidden_states/{slot}")
                want = stacked[slot, start:stop].cpu()
                if like is not None:
                    with ShardReader(like) as other:
                        equal &= torch.equal(got.view(torch.uint8),
                                             other.get_tensor(f"s{i}/hidden_states/{slot}").view(torch.uint8))
                elif codec.lossy:
                    equal &= bool(((got.float() - want.float()).norm() / want.float().norm()) < 0.05)
                else:
                    equal &= torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return out.size, equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--states", type=Path)
    args = parser.parse_args()
    if args.states:
        from safetensors import safe_open

        with safe_open(args.states, framework="pt") as f:
            keys = sorted(k for k in f.keys() if "/hidden_states/" in k)
            per_layer = {}
            for k in keys:
                per_layer.setdefault(int(k.rsplit("/", 1)[1]), []).append(f.get_tensor(k))
        stacked = torch.stack([torch.cat(per_layer[s]) for s in sorted(per_layer)]).cuda()
    else:
        torch.manual_seed(0)
        stacked = (torch.randn(args.layers, args.rows, args.hidden, device="cuda") *
                   torch.linspace(0.5, 8, args.layers, device="cuda").view(-1, 1, 1)).to(torch.bfloat16)
    layers, rows, width = stacked.shape
    cut = [0, rows // 3, rows // 3 + 1, rows]  # spans as samples give them, one of a single row
    spans = list(zip(cut[:-1], cut[1:]))
    raw = stacked.numel() * stacked.element_size()
    ok, workdir = True, Path(tempfile.mkdtemp())
    print(f"states [{layers}, {rows}, {width}] {stacked.dtype}, {raw / 1e9:.2f} GB; spans {spans}")

    stream = torch.cuda.Stream()
    encoder = NvcompStepEncoder(stream)
    with torch.cuda.stream(stream):
        step, seconds = device_seconds(lambda: encoder(stacked, spans))
    size, equal = roundtrip(Codec("nvcomp-ans"), step, stacked, spans, workdir)
    ok &= equal
    print(f"nvcomp-ans: ratio {raw / step.data.numel():.3f} on the device ({raw / size:.3f} as a shard), encode "
          f"{raw / seconds / 1e9:.0f} GB/s (device time), read back bit for bit: {equal}")

    eager, eager_s = device_seconds(lambda: fp8_encode_step(stacked, fused=False))
    step, seconds = device_seconds(lambda: fp8_encode_step(stacked))  # compiled: what the capture runs on CUDA
    cpu = fp8_encode_step(stacked.cpu())
    # codes and scales (the sums of squares are reductions in another order on each)
    cpu_rows = cpu.host_rows(cpu.data, "fp8-e4m3")
    for name, made in (("compiled", step), ("eager", eager)):
        made_rows = made.host_rows(made.data.cpu(), "fp8-e4m3")
        scales_same = all(torch.equal(g.aux[:, 0], c.aux[:, 0]) for g, c in zip(made_rows, cpu_rows))
        codes_differ = sum(int((g.codes != c.codes).sum()) for g, c in zip(made_rows, cpu_rows)) / stacked.numel()
        errors = [float(g.aux[:, 1].double().sum() / g.aux[:, 2].double().sum()) ** 0.5 for g in made_rows]
        print(f"fp8-e4m3 on the GPU, {name}: scales == the CPU's: {scales_same}, codes differing from the CPU's: "
              f"{codes_differ:.2e} of all, relative error per layer {', '.join(f'{e:.4f}' for e in errors)}")
    size, close = roundtrip(Codec("fp8-e4m3"), step, stacked, spans, workdir)
    ok &= close
    print(f"fp8-e4m3: ratio {raw / step.data.numel():.3f}, encode {raw / seconds / 1e9:.0f} GB/s compiled, "
          f"{raw / eager_s / 1e9:.0f} GB/s eager (x{eager_s / seconds:.1f}; device time), read back within the "
          f"bound: {close}")

    with torch.cuda.stream(stream):
        step, seconds = device_seconds(lambda: fp8_ans_encode_step(stacked, spans, encoder))
    size, same = roundtrip(Codec("fp8-e4m3-ans"), step, stacked, spans, workdir, like=workdir / "fp8-e4m3.safetensors")
    ok &= same
    print(f"fp8-e4m3-ans: ratio {raw / step.data.numel():.3f} on the device ({raw / size:.3f} as a shard), encode "
          f"{raw / seconds / 1e9:.0f} GB/s (device time, fp8 and ANS), read back bit for bit as fp8-e4m3: {same}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
