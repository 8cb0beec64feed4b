"""Correctness on a GPU (run on the device before its benchmark): the demo model's bf16 states from the CUDA
build of vLLM against Hugging Face on the same GPU, with chunked prefill and 16 requests in flight; then every
other shard is computed again, beside other neighbours than the first time (vLLM's asynchronous scheduling,
which the CPU build lacks, admits the next shard while the last one finishes), and must come out byte-identical.

    python3 bench/gpu_check.py WORKDIR
Prints a summary line and exits 1 if any sample is off by more than twice HF's own bf16 error or any shard
computed again differs.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import extraction_params, hf_states, load_hf, random_prompts, rel_error, write_prompt_jsonl  # noqa: E402

from eagle_states.capture.engine import EngineHolder  # noqa: E402
from eagle_states.dataset.layout import receipt_path, shard_path  # noqa: E402
from eagle_states.dataset.reader import Dataset  # noqa: E402
from eagle_states.demo import make_demo_model  # noqa: E402
from eagle_states.extraction.driver import Extraction, run_extraction  # noqa: E402

if __name__ == "__main__":
    work = Path(sys.argv[1])
    model = make_demo_model(work / "demo-model")
    prompts = random_prompts([1, 2, 5, 17, 63, 64, 65, 130, 200, 257, 40, 40, 9, 100, 33, 3, 700, 1500], 500, seed=1)
    source = write_prompt_jsonl(work / "prompts.jsonl", prompts)
    layers = [0, 2, 4, 5, 8]
    params = extraction_params(model, source, work / "dataset", layer_ids=layers, dtype="bfloat16",
                               shard_max_tokens=512, max_model_len=2048, max_num_batched_tokens=256,
                               max_num_seqs=16, gpu_memory_utilization=0.3)
    engines = EngineHolder()
    manifest = run_extraction(Extraction(params), progress=False, engines=engines)
    again = manifest["shards"][1::2]
    for shard in again:
        shard_path(work / "dataset", shard["name"]).unlink()
        receipt_path(work / "dataset", shard["name"]).unlink()
    recomputed = {s["name"]: s["sha256"] for s in run_extraction(Extraction(params), progress=False,
                                                                  engines=engines)["shards"]}
    engines.close()
    changed = [s["name"] for s in again if recomputed[s["name"]] != s["sha256"]]
    exact = load_hf(model, torch.float32).cuda()
    own = load_hf(model, torch.bfloat16).cuda()
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
    print(f"GPU CHECK: {len(prompts)} samples, worst (ours / HF bf16 error) = {worst_ratio:.2f}, failures {failures}; "
          f"{len(again)} of {len(manifest['shards'])} shards computed again beside other neighbours, "
          f"{len(changed)} differ {changed}")
    sys.exit(1 if failures or changed else 0)
