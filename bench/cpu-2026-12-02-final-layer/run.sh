# The final-layer control on the CPU build: a demo target (8 x 256, 160 steps) of RECIPE, COUNT demo conversations of
# that recipe and seed 0 extracted at LAYER_IDS (fp32), then the acceptance harness at draft seeds 0 and 1.
#   bash bench/cpu-2026-12-02-final-layer/run.sh [WORK [RECIPE [LAYER_IDS [COUNT]]]]    (from the repository root;
#   about 15 minutes on 2 cores; defaults /tmp/acc/w1 chat 2,4,7,8 300; the keyed run: /tmp/acc/k2 keyed 1,4,7,8 2000)
set -euo pipefail
B=$PWD/.venv/bin
W=$(realpath -m "${1:-/tmp/acc/w1}")
bash "$(dirname "$0")/dataset.sh" "$W" "${2:-chat}" "${3:-2,4,7,8}" "${4:-300}"
cd "$W"
common="--epochs 1 --max-steps 40 --prompts 16 --prompt-seed 2 --max-tokens 48 --dtype float32"
$B/eagle-states acceptance dataset --out acceptance $common --seed 0 \
    --controls token-shift,final-layer-off-by-one,layer-off-by-one
$B/eagle-states acceptance dataset --out acceptance-seed1 $common --seed 1 \
    --controls token-shift,final-layer-off-by-one,layer-off-by-one-down
