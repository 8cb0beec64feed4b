# The keyed target's drafts trained longer and served on more prompts, at several draft seeds: the correct draft,
# the token-shift and both aux-layer controls, and a draft trained on the same conversations stored fp8-e4m3
# (issue #29's acceptance cost, on the target whose drafts need the states).
#   bash bench/cpu-2026-12-02-keyed-seeds/run.sh [WORK [STEPS [PROMPTS [SEEDS]]]]    (from the repository root;
#   defaults /tmp/acc/k3 300 64 "0 1")
set -euo pipefail
B=$PWD/.venv/bin
W=$(realpath -m "${1:-/tmp/acc/k3}")
STEPS=${2:-300}
PROMPTS=${3:-64}
SEEDS=${4:-0 1}
bash bench/cpu-2026-12-02-final-layer/dataset.sh "$W" keyed 1,4,7,8 2000
cd "$W"
$B/python - <<'PY'
import yaml

params = yaml.safe_load(open("params.yaml"))
params["extract"]["codec"] = "fp8-e4m3"  # the same prepared input, stored fp8
params["output"]["dir"] += "-fp8"
params["output"]["prefect_results"] += "-fp8"
params["validate"]["report"] = "validation-fp8.json"
open("params-fp8.yaml", "w").write(yaml.safe_dump(params))
PY
$B/eagle-states extract --params params-fp8.yaml --no-progress
$B/eagle-states validate --params params-fp8.yaml
common="--epochs 20 --max-steps $STEPS --prompts $PROMPTS --prompt-seed 2 --max-tokens 48 --dtype float32"
for seed in $SEEDS; do
    $B/eagle-states acceptance dataset --out acceptance-seed$seed $common --seed $seed \
        --controls token-shift,layer-off-by-one,layer-off-by-one-down,final-layer-off-by-one
    $B/eagle-states acceptance dataset-fp8 --out acceptance-fp8-seed$seed $common --seed $seed --controls ''
done
