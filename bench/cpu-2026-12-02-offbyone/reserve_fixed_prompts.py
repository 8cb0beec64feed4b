"""The drafts of earlier acceptance runs served again on the held-out prompts as `heldout_prompts` makes them
since the fix (the tokens of the prepared rendering before the first reply), nothing retrained.

    python bench/cpu-2026-12-02-offbyone/reserve_fixed_prompts.py TARGET ACCEPTANCE_DIR [ACCEPTANCE_DIR ...]
        [--drafts none,layer-off-by-one,layer-off-by-one-down,fc-zeroed] [--prompts 32 --max-tokens 48]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("dirs", nargs="+")
ap.add_argument("--drafts", default="none,layer-off-by-one,layer-off-by-one-down,fc-zeroed")
ap.add_argument("--prompts", type=int, default=32)
ap.add_argument("--max-tokens", type=int, default=48)
args = ap.parse_args()

from eagle_states.acceptance.harness import heldout_prompts
from eagle_states.capture.speculative import measure_acceptance

prompts = heldout_prompts(Path(args.target), args.prompts, 2)
for d in args.dirs:
    for name in args.drafts.split(","):
        draft = Path(d) / f"draft-{name}"
        if not draft.exists():
            continue
        served = measure_acceptance(Path(args.target), draft, prompts, max_tokens=args.max_tokens, dtype="float32")
        print(json.dumps({"dir": d, "draft": name, **served.summary()}), flush=True)
