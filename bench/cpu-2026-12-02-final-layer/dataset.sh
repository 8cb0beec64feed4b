# A demo target (8 x 256, 160 steps) of RECIPE and COUNT demo conversations of that recipe and seed 0, prepared,
# extracted at LAYER_IDS (fp32) and validated in WORK (params.yaml, prepared/, dataset/); used by the CPU acceptance
# benches of this date.
#   bash bench/cpu-2026-12-02-final-layer/dataset.sh WORK RECIPE LAYER_IDS COUNT    (from the repository root)
set -euo pipefail
B=$PWD/.venv/bin
W=$(realpath -m "${1:?WORK}")  # the defaults are the callers' (run.sh's)
RECIPE=${2:?RECIPE}
IDS=${3:?LAYER_IDS}
COUNT=${4:?COUNT}
mkdir -p "$W"
[ -d "$W/target-$RECIPE" ] || $B/eagle-states make-demo-model "$W/target-$RECIPE" --train-steps 160 --recipe "$RECIPE"
$B/python - "$W" "$RECIPE" "$IDS" "$COUNT" <<'PY'
import sys
from pathlib import Path

import yaml

from eagle_states.config import PipelineParams
from eagle_states.demo import write_demo_conversations

work, recipe, ids, count = Path(sys.argv[1]), sys.argv[2], [int(k) for k in sys.argv[3].split(",")], int(sys.argv[4])
params = PipelineParams.model_validate({
    "model": {"path": str(work / f"target-{recipe}"), "build_demo_if_missing": False},
    "data": {"path": str(write_demo_conversations(work / "conversations.jsonl", count=count, seed=0, recipe=recipe))},
    "prepare": {"out": str(work / "prepared"), "max_length": 1024},
    "extract": {"dtype": "float32", "max_model_len": 1280, "max_num_batched_tokens": 4096,
                "shard_max_tokens": 16384, "layer_ids": ids},
    "validate": {"report": str(work / "validation.json")},
    "output": {"dir": str(work / "dataset"), "prefect_results": str(work / ".prefect-results")}})
(work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
PY
cd "$W"
$B/eagle-states prepare --params params.yaml --no-progress
$B/eagle-states extract --params params.yaml --no-progress
$B/eagle-states validate --params params.yaml
