"""Correctness on a GPU (run on the device before its benchmark), for the two model families the project serves.

Llama (the demo model): bf16 states from the CUDA build of vLLM against Hugging Face on the same GPU, with
chunked prefill and 16 requests in flight; then every other shard is computed again, beside other neighbours than
the first time (vLLM's asynchronous scheduling admits the next shard while the last one finishes), and must come
out byte-identical (with an nvCOMP codec, whose buffers follow the scheduler's steps: its tensors as read back). Fails if any sample is off by more than twice HF's own bf16 error.

DeepSeek-V3 (MLA with DeepSeek's own head sizes, which CUDA's MLA kernels need; MoE after a dense layer): every
layer boundary is captured (ids 0..N) in bf16 with chunked prefill and 16 requests in flight. Comparing whole
models cannot tell a capture bug from MoE routing that flips on a near-tie (a random router has many; vLLM's and
HF's routers see inputs a bf16 rounding apart), and a flipped token then spreads through attention. So each layer
is checked on its own, teacher-forced: HF's layer k is run on the states vLLM captured entering layer k, and its
output is compared with what vLLM captured entering layer k+1. Every token is *held* to the bf16 tolerance
(twice HF's own bf16 error for that token, at least twice the layer's median) unless, at an MoE layer, its top-k
expert choice is within ROUTING_TIE of a tie in HF's own fp32 router on those inputs; such a token beyond the
tolerance is *counted* as a routing flip, and more than MAX_FLIPS of a layer's tokens flipped fails the check.
A deliberately shifted capture (rows one token off) is run through the same criterion and must fail it.

With `--codec C` the Llama check extracts with that codec and also without one, on the same engine, and the
codec's dataset must pass validation on this machine and read back through `Dataset` bit for bit as the plain one
(lossless codecs), or within the codec's error bound of it with the error its validation recorded (fp8-e4m3); and
made again by an engine with a host buffer of 0.0001 GiB (the longer samples spilled: as a step codec encoded them,
or uncompressed for Blosc2, which compresses them as they are read back) it must read back bit for bit as it did.

    python3 bench/gpu_check.py WORKDIR [--only llama|deepseek] [--device cpu] [--codec nvcomp-ans]
Prints one summary per model (per layer for DeepSeek) and exits 1 if either fails. `--device cpu` runs it on
the CPU build (DeepSeek with the CPU build's head sizes), to try the check itself.
"""

import argparse
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import extraction_params, hf_states, load_hf, random_prompts, rel_error, write_prompt_jsonl  # noqa: E402

from eagle_states.capture.engine import EngineHolder  # noqa: E402
from eagle_states.dataset.codec import NVCOMP_CODECS  # noqa: E402
from eagle_states.dataset.layout import receipt_path, shard_path  # noqa: E402
from eagle_states.dataset.reader import Dataset  # noqa: E402
from eagle_states.dataset.shard_file import ShardReader  # noqa: E402
from eagle_states.demo import make_demo_model  # noqa: E402
from eagle_states.extraction.driver import Extraction, run_extraction  # noqa: E402

LENGTHS = [1, 2, 5, 17, 63, 64, 65, 130, 200, 257, 40, 40, 9, 100, 33, 3, 700, 1500]
ROUTING_TIE = 0.02  # top-k margin of the router's scores (sigmoid + bias) below which a flip is engine numerics
MAX_FLIPS = 0.05  # of a layer's tokens: more flips than this is not a few near-ties any more


def shard_tensors(dataset: Path, name: str) -> dict[str, torch.Tensor]:
    """A shard's tensors as read back (decoded)."""
    with ShardReader(shard_path(dataset, name)) as shard:
        return {key: shard.get_tensor(key) for key in shard.keys()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (NaNs included)."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def codec_check(work: Path, params, engines: EngineHolder, codec: str) -> tuple[bool, str]:
    """The codec's dataset against a plain one of the same prompts from the same engine."""
    from eagle_states.dataset.codec import Codec
    from eagle_states.validate import validate_dataset

    plain = params.override({"output.dir": str(work / "dataset-plain"), "extract.codec": "none"})
    run_extraction(Extraction(plain), progress=False, engines=engines)
    verdict = validate_dataset(Path(params.output.dir))
    lossy, worst, differ = Codec(codec).lossy, 0.0, 0
    for ours, theirs in zip(Dataset(Path(params.output.dir)), Dataset(work / "dataset-plain")):
        for a, b in zip(ours.hidden_states, theirs.hidden_states):
            worst = max(worst, rel_error(a.float(), b.float()))
            differ += not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    recorded = verdict.summary.get("relative_error_per_layer", {})
    ok = verdict.valid and (worst < 0.05 if lossy else differ == 0)
    return ok, (f"CODEC {codec} {'PASS' if ok else 'FAIL'}: validation {'valid' if verdict.valid else 'INVALID'} "
                f"on this machine; read back against the plain capture: {differ} tensors differ, worst relative "
                f"error {worst:.4f}" + (f", recorded per layer {recorded}" if recorded else ""))


def _spilled_extraction(params_json: str, result) -> None:
    """`spill_check`'s extraction, in a process of its own: the bytes it spilled into `result` (a queue)."""
    from eagle_states.config import PipelineParams

    engines = EngineHolder()
    try:
        run_extraction(Extraction(PipelineParams.model_validate_json(params_json)), progress=False, engines=engines)
        result.put(engines.engine.capture_stats().spilled_bytes)
    finally:
        engines.close()


def spill_check(work: Path, params) -> tuple[bool, str]:
    """The codec's dataset made again by an engine with a host buffer so small (the pinned pool's least, 4 steps)
    that the samples past 2 steps are spilled (as a step codec encoded them; Blosc2's uncompressed, compressed as
    they are read back): it must read back bit for bit. The engine runs in a process of its own: on the H200, vLLM
    refused to start a second one in this process (free memory grew while it profiled, 20 MB, whatever was given
    back first)."""
    spilled = params.override({"output.dir": str(work / "dataset-spilled"), "extract.host_buffer_gb": 0.0001})
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    child = context.Process(target=_spilled_extraction, args=(spilled.model_dump_json(by_alias=True), result))
    child.start()
    child.join()
    if child.exitcode != 0:
        return False, f"SPILL {params.extract.codec} FAIL: its extraction exited with {child.exitcode}"
    spilled_gb = result.get() / 1e9
    differ = sum(not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                 for ours, again in zip(Dataset(Path(params.output.dir)), Dataset(work / "dataset-spilled"))
                 for a, b in zip(ours.hidden_states, again.hidden_states))
    ok = spilled_gb > 0 and differ == 0
    return ok, (f"SPILL {params.extract.codec} {'PASS' if ok else 'FAIL'}: made again with a host buffer of 0.0001 "
                f"GiB, {spilled_gb:.4f} GB spilled: {differ} tensors differ from the samples held in memory")


def llama_check(work: Path, device: str, codec: str = "none") -> tuple[bool, str]:
    model = make_demo_model(work / "demo-model")
    prompts = random_prompts(LENGTHS, 500, seed=1)
    source = write_prompt_jsonl(work / "prompts.jsonl", prompts)
    layers = [0, 2, 4, 5, 8]
    params = extraction_params(model, source, work / "dataset", layer_ids=layers, dtype="bfloat16",
                               shard_max_tokens=512, max_model_len=2048, max_num_batched_tokens=256,
                               max_num_seqs=16, gpu_memory_utilization=0.3 if device == "cuda" else 0.2,
                               codec=codec)
    engines = EngineHolder()
    manifest = run_extraction(Extraction(params), progress=False, engines=engines)
    codec_result = codec_check(work, params, engines, codec) if codec != "none" else (True, "")
    again = manifest["shards"][1::2]
    # nvCOMP's buffers follow how the scheduler split the samples into steps, so such a shard computed again holds
    # the same states in other bytes: its tensors as read back are compared, everyone else's bytes
    by_content = codec in NVCOMP_CODECS
    before = {s["name"]: shard_tensors(work / "dataset", s["name"]) if by_content else s["blake3"] for s in again}
    for shard in again:
        shard_path(work / "dataset", shard["name"]).unlink()
        receipt_path(work / "dataset", shard["name"]).unlink()
    recomputed = {s["name"]: s["blake3"] for s in run_extraction(Extraction(params), progress=False,
                                                                  engines=engines)["shards"]}
    engines.close()
    if codec != "none":
        spill_ok, spill_text = spill_check(work, params)
        codec_result = codec_result[0] and spill_ok, f"{codec_result[1]}\n{spill_text}"
    changed = [name for name, was in before.items()
               if not (same_tensors(was, shard_tensors(work / "dataset", name)) if by_content
                       else recomputed[name] == was)]
    exact = load_hf(model, torch.float32).to(device)
    own = load_hf(model, torch.bfloat16).to(device)
    worst_ratio, failures = 0.0, 0
    for sample, prompt in zip(Dataset(work / "dataset"), prompts):
        assert sample.input_ids.tolist() == prompt and len(sample.hidden_states) == len(layers)
        ref = [t.cpu() for t in hf_states(exact, prompt, layers)]
        ref_bf16 = [t.cpu() for t in hf_states(own, prompt, layers)]
        for j, k in enumerate(layers[1:], start=1):
            ours, theirs = rel_error(sample.hidden_states[j], ref[j]), rel_error(ref_bf16[j], ref[j])
            if len(prompt) >= 16:
                worst_ratio = max(worst_ratio, ours / max(theirs, 1e-6))
                failures += ours > 2 * theirs + 1e-3
    if Dataset(work / "dataset").manifest["codec"].get("lossy"):  # held to HF through the plain capture
        failures = 0
    ok = not failures and not changed and codec_result[0]
    return ok, (f"LLAMA {'PASS' if ok else 'FAIL'}: {len(prompts)} samples, worst (ours / HF bf16 error) = "
                f"{worst_ratio:.2f}, failures {failures}; {len(again)} of {len(manifest['shards'])} shards computed "
                f"again beside other neighbours, {len(changed)} differ {changed}"
                f"{' (tensors read back)' if by_content else ''}" +
                (f"\n{codec_result[1]}" if codec_result[1] else ""))


class _Stop(Exception):
    pass


@torch.no_grad()
def teacher_forced_layer(model, k: int, input_ids: list[int], entering: torch.Tensor):
    """HF's layer k run on `entering` ([T, H], the states vLLM captured entering layer k): returns its output
    [T, H] in fp32 and, for an MoE layer, each token's top-k margin in the router's scores (else None)."""
    layer = model.model.layers[k]
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    seen = {}

    def replace_input(module, args, kwargs):
        states = entering.to(device=model.device, dtype=model.dtype).unsqueeze(0)
        if args:
            return (states, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": states}

    def keep_output(module, args, kwargs, output):
        seen["out"] = (output[0] if isinstance(output, tuple) else output)[0].float()
        raise _Stop

    handles = [layer.register_forward_pre_hook(replace_input, with_kwargs=True),
               layer.register_forward_hook(keep_output, with_kwargs=True)]
    if gate is not None and hasattr(gate, "e_score_correction_bias"):
        handles.append(gate.register_forward_pre_hook(lambda m, args: seen.__setitem__("gate_in", args[0])))
    try:
        model(torch.tensor([input_ids], device=model.device))
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    margins = None
    if "gate_in" in seen:
        x = seen["gate_in"].reshape(-1, gate.weight.shape[1]).float()
        scores = torch.nn.functional.linear(x, gate.weight.float()).sigmoid() + gate.e_score_correction_bias.float()
        top = scores.topk(gate.top_k + 1, dim=-1).values
        margins = (top[:, gate.top_k - 1] - top[:, gate.top_k]).cpu()  # n_group = 1: the plain top-k boundary
    return seen["out"].cpu(), margins


def per_token_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.norm(a.float() - b.float(), dim=-1) / torch.linalg.norm(b.float(), dim=-1).clamp_min(1e-12)


def judge_layer(pairs) -> dict:
    """`pairs`: per sample, (ours [T,H], HF fp32 [T,H], HF bf16 [T,H], margins [T] or None) for one layer.
    Every token away from a routing tie is held to the tolerance (`failed` counts those beyond it); a near-tie
    token beyond it is a routing flip (`flips`), allowed up to MAX_FLIPS of the layer's tokens."""
    errors = [(per_token_error(ours, exact), per_token_error(own, exact), margins)
              for ours, exact, own, margins in pairs]
    median_own = torch.cat([own for _, own, _ in errors]).median().item()
    held = near_ties = failed = flips = 0
    worst = 0.0
    for ours, own, margins in errors:
        beyond = ours > 2 * torch.maximum(own, torch.full_like(own, median_own)) + 1e-3
        tie = margins < ROUTING_TIE if margins is not None else torch.zeros_like(beyond)
        held, near_ties = held + int((~tie).sum()), near_ties + int(tie.sum())
        failed, flips = failed + int((beyond & ~tie).sum()), flips + int((beyond & tie).sum())
        worst = max(worst, (ours / (2 * torch.maximum(own, torch.full_like(own, median_own)) + 1e-3))[~tie].max().item()
                    if (~tie).any() else 0.0)
    return {"held": held, "near_ties": near_ties, "failed": failed, "flips": flips, "worst_of_tolerance": worst,
            "passed": failed == 0 and flips <= MAX_FLIPS * (held + near_ties)}


def deepseek_check(work: Path, device: str) -> tuple[bool, str]:
    arch = "deepseek-v3-cuda" if device == "cuda" else "deepseek-v3"
    num_layers = 4
    model = make_demo_model(work / "deepseek-model", arch=arch, num_layers=num_layers, hidden_size=512,
                            num_heads=4, device=device)
    prompts = random_prompts(LENGTHS, 500, seed=2)
    source = write_prompt_jsonl(work / "deepseek-prompts.jsonl", prompts)
    layers = list(range(num_layers + 1))  # every boundary: entering each layer, then the final pre-norm state
    params = extraction_params(model, source, work / "deepseek-dataset", layer_ids=layers, dtype="bfloat16",
                               shard_max_tokens=1024, max_model_len=2048, max_num_batched_tokens=256,
                               max_num_seqs=16, gpu_memory_utilization=0.3 if device == "cuda" else 0.2)
    run_extraction(Extraction(params), progress=False)
    exact = load_hf(model, torch.float32).to(device)
    own = load_hf(model, torch.bfloat16).to(device)
    samples = [(s.hidden_states, p) for s, p in zip(Dataset(work / "deepseek-dataset"), prompts) if len(p) >= 16]
    references = {(i, k): (teacher_forced_layer(exact, k, prompt, states[k]),
                           teacher_forced_layer(own, k, prompt, states[k])[0])
                  for i, (states, prompt) in enumerate(samples) for k in range(num_layers)}
    lines, passed = [], True
    for shifted in (False, True):
        verdicts = []
        for k in range(num_layers):
            pairs = []
            for i, (states, prompt) in enumerate(samples):
                (out_exact, margins), out_own = references[i, k]
                ours = states[k + 1].roll(1, dims=0) if shifted else states[k + 1]
                pairs.append((ours, out_exact, out_own, margins))
            verdicts.append(judge_layer(pairs))
        if shifted:
            caught = not all(v["passed"] for v in verdicts)
            passed &= caught
            lines.append(f"  a capture shifted by one token: {'caught' if caught else 'NOT CAUGHT'} "
                         f"(held tokens beyond tolerance per layer {[v['failed'] for v in verdicts]})")
        else:
            passed &= all(v["passed"] for v in verdicts)
            lines += [f"  layer {k} ({'dense' if k == 0 else 'MoE'}): {v['held']} tokens held, {v['failed']} of "
                      f"them beyond tolerance (worst {v['worst_of_tolerance']:.2f} of it); {v['near_ties']} near "
                      f"a routing tie, {v['flips']} of them beyond tolerance (routing flips)"
                      for k, v in enumerate(verdicts)]
    head = (f"DEEPSEEK-V3 {'PASS' if passed else 'FAIL'}: {arch}, {len(prompts)} samples ({len(samples)} of 16+ "
            f"tokens judged), layers 0..{num_layers} in bf16, max_num_batched_tokens 256, 16 requests in flight; "
            f"teacher-forced per layer, near-tie margin {ROUTING_TIE}, at most {MAX_FLIPS:.0%} flips")
    return passed, "\n".join([head, *lines])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--only", choices=["llama", "deepseek"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--codec", default="none", help="the Llama check's codec, checked against a plain capture")
    args = parser.parse_args()
    results = [llama_check(args.work, args.device, args.codec)] if args.only in (None, "llama") else []
    results += [deepseek_check(args.work, args.device)] if args.only in (None, "deepseek") else []
    for _, text in results:
        print(text)
    sys.exit(0 if all(ok for ok, _ in results) else 1)
