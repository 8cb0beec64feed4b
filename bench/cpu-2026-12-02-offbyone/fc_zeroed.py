"""The correct draft of an acceptance run with its `fc` (the projection of the target's states) zeroed, served
on the same held-out prompts: how much of its acceptance comes from the states.

    python bench/cpu-2026-12-02-offbyone/fc_zeroed.py ACCEPTANCE_DIR TARGET [--prompts 32 --max-tokens 48]
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ap = argparse.ArgumentParser()
ap.add_argument("acceptance_dir")
ap.add_argument("target")
ap.add_argument("--prompts", type=int, default=32)
ap.add_argument("--max-tokens", type=int, default=48)
args = ap.parse_args()

from safetensors.torch import load_file, save_file

from eagle_states.acceptance.harness import heldout_prompts
from eagle_states.capture.speculative import measure_acceptance

src, dst = Path(args.acceptance_dir) / "draft-none", Path(args.acceptance_dir) / "draft-fc-zeroed"
if not dst.exists():
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    zeroed = [k for k in weights if k.startswith("fc.")]
    assert zeroed, list(weights)
    for k in zeroed:
        weights[k] = weights[k].zero_()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
served = measure_acceptance(Path(args.target), dst, heldout_prompts(Path(args.target), args.prompts, 2),
                            max_tokens=args.max_tokens, dtype="float32")
print(json.dumps({"draft": "fc-zeroed", **served.summary()}))
