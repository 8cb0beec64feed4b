#!/bin/sh
# run_acc.sh TARGET WORK LAYER_IDS CONVS PROMPTS [extra acceptance args]
set -e
T=$1; W=$2; IDS=$3; N=$4; P=$5; shift 5
cd "$(dirname "$0")/../.."
mkdir -p $W
.venv/bin/python - "$T" "$W" "$IDS" "$N" <<'PY'
import sys, json, yaml
from pathlib import Path
sys.path.insert(0, ".")
from eagle_states.config import PipelineParams
from eagle_states.demo import write_demo_conversations
t, w, ids, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
recipe = json.loads((t / "target_training.json").read_text()).get("recipe", "chat")
params = PipelineParams.model_validate({
    "model": {"path": str(t), "build_demo_if_missing": False},
    "data": {"path": str(write_demo_conversations(w / "conversations.jsonl", count=n, seed=0, recipe=recipe))},
    "prepare": {"out": str(w / "prepared"), "max_length": 1024},
    "extract": {"dtype": "float32", "max_model_len": 1280, "max_num_batched_tokens": 4096, "shard_max_tokens": 16384,
                "layer_ids": ids},
    "validate": {"report": str(w / "validation.json")},
    "output": {"dir": str(w / "dataset"), "prefect_results": str(w / ".prefect-results")}})
(w / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
PY
for s in prepare extract; do nice -n 10 .venv/bin/eagle-states $s --params $W/params.yaml --no-progress; done
nice -n 10 .venv/bin/eagle-states validate --params $W/params.yaml
nice -n 10 .venv/bin/eagle-states acceptance $W/dataset --out $W/acceptance --prompts $P --prompt-seed 2 --max-tokens 48 --dtype float32 "$@"
