"""The peer's extraction: speculators' data generation path (vLLM's `extract_hidden_states` with the hidden-states
connector, what `speculators generate-offline-data` asks a vLLM server for) on the token ids of one of our
`speculators` exports (row i), into a copy of that export whose hidden_states/hs_{i} are the peer's.

    python bench/peer_extract.py MODEL OUR_EXPORT OUT --layer-ids 2,4,5,8 [--dtype float32]

Prints one JSON line: the peer's seconds for the extraction (model load excluded), tokens, how many hs_{i} are
bitwise equal to ours, and the worst and best relative error of a sample's states against ours. Its own process: the connector's reader waits on a lock the writer holds until a later
engine step, so the engine core must run in a process of its own (vLLM's default), not in this one.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("export")
    ap.add_argument("out")
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                    help="on a GPU (vLLM wants this share of the device free at start; our capture's default)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the CPU connector, for vLLM to import
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    from vllm.platforms import current_platform

    ours, out = Path(args.export), Path(args.out)
    staging = out.parent / f"{out.name}.staging"
    for stale in (out, staging):  # an earlier run's, stopped
        shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(ours, out, ignore=shutil.ignore_patterns("hidden_states"))
    (out / "hidden_states").mkdir()
    staging.mkdir()
    table = load_from_disk(str(ours))
    ids = [table[i]["input_ids"].tolist() for i in range(len(table))]
    cpu = current_platform.is_cpu()
    connector = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "peer_hs_connector"} \
        if cpu else {"kv_connector": "ExampleHiddenStatesConnector"}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max(map(len, ids)) + 8, enforce_eager=True,
              enable_prefix_caching=False, seed=0,
              **({"kv_cache_memory_bytes": 1 << 30} if cpu else {"gpu_memory_utilization": args.gpu_memory_utilization}),
              **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if cpu else {}),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": [int(k) for k in args.layer_ids.split(",")]}}},
              kv_transfer_config={**connector, "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": str(staging)}})
    started = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], SamplingParams(max_tokens=1),
                           use_tqdm=False)
    for i, output in enumerate(outputs):
        path = output.kv_transfer_params["hidden_states_path"]
        load_hidden_states(path)  # waits for its writer
        shutil.move(path, out / "hidden_states" / f"hs_{i}.safetensors")
    seconds = time.monotonic() - started
    errors = []  # per sample: ||peer - ours|| / ||ours|| over all its layers and tokens (0: bitwise equal)
    for i in range(len(ids)):
        peer = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"].double()
        mine = load_file(str(ours / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"].double()
        errors.append(float((peer - mine).norm() / mine.norm()) if peer.shape == mine.shape else float("inf"))
    shutil.rmtree(staging, ignore_errors=True)
    print(json.dumps({"seconds": round(seconds, 3), "tokens": sum(map(len, ids)), "samples": len(ids),
                      "bitwise_equal_to_ours": sum(e == 0 for e in errors),
                      "relative_error_worst": max(errors), "relative_error_best": min(errors)}))
