# Issue #27 on one H200, stage by stage (each well inside a device call's 10 minutes; the machine keeps /tmp
# between calls made back to back):
#   bash bench/h200_acceptance.sh setup        checks the imports (h200_env.sh installs the wheels of .whl/:
#                                              speculators and what it imports; .whl-nvcomp/: nvCOMP)
#   bash bench/h200_acceptance.sh target       a larger keyed target trained on the GPU
#   bash bench/h200_acceptance.sh acceptance   extraction -> drafts (this project's loop on speculators' model, the
#                                              controls: $CONTROLS, set empty for none) -> vLLM's EAGLE-3 acceptance
#   bash bench/h200_acceptance.sh fp8          issue #29: the acceptance stage's input stored fp8-e4m3-ans, a draft
#                                              on it and one on the bf16 states at draft seed $SEEDS (default 0),
#                                              side by side (after acceptance; about 8 minutes, 4 for a further
#                                              seed: SEEDS=1 in a call of its own reuses the fp8 dataset)
#   bash bench/h200_acceptance.sh speculators  the correct draft trained by `speculators train` itself, beside the
#                                              acceptance stage's (resumed, served again): a stage of its own, so
#                                              that a failure of speculators' trainer costs no other figure
#   bash bench/h200_acceptance.sh peer         extraction speed: plain prefill, ours, speculators' data generation,
#                                              one run, Llama-3.1-8B shape (random weights)
# Needs vLLM from ../shared/gpukit installed on the machine (/tmp/site). Results go to $OUT.
source bench/h200_env.sh
W=/tmp/acc
CONTROLS=${CONTROLS-token-shift,final-layer-off-by-one,layer-off-by-one,layer-off-by-one-down}
RECIPE="--epochs 4 --max-steps 1000 --prompts 64 --max-tokens 64"  # 4,000 conversations: about 350 draft steps
mkdir -p "$OUT" "$W"
case "${1:?stage}" in
setup)
    python3 -c "import speculators.train.cli, datasets, pandera, blake3, eagle_states.acceptance.harness; print('imports ok')"
    grep -c norm_output /tmp/site/vllm/transformers_utils/configs/speculators/algos.py ;;
target)
    python3 -m eagle_states make-demo-model "$W/target" --device cuda --layers 12 --hidden 768 --recipe keyed \
        --train-steps 2000 --train-conversations 20000
    cp "$W/target/target_training.json" "$OUT/" ;;
acceptance)
    python3 bench/cpu-2026-12-02-final-layer/probe_lens.py "$W/target" --conversations 100 | tee "$OUT/probe_lens.json"
    python3 bench/acceptance.py --model "$W/target" --out "$W/bench" --conversations 4000 --layer-ids 2,6,11,12 \
        --dtype bfloat16 --device cuda $RECIPE \
        --controls "$CONTROLS" --skip peer,regenerated \
        --json "$OUT/acceptance.json" 2>&1 | tee "$OUT/acceptance.log" | grep -v "^\(INFO\|DEBUG\)" ;;
speculators)
    python3 -m eagle_states acceptance "$W/bench/original/dataset" --out "$W/bench/original/acceptance" \
        --model "$W/target" --dtype bfloat16 --device cuda $RECIPE --speculators-train --controls "" \
        >"$OUT/acceptance-speculators-train.log" 2>&1
    echo "exit $?"; tail -4 "$OUT/acceptance-speculators-train.log"
    cp "$W/bench/original/acceptance/acceptance.json" "$OUT/acceptance-speculators-train.json"
    cp "$W/bench/original/acceptance/draft-speculators-train.run/train.log" "$OUT/speculators-train.log" 2>/dev/null ;;
fp8)
    python3 bench/acceptance_fp8.py --bench-out "$W/bench" --model "$W/target" --out "$W/fp8" --codec fp8-e4m3-ans \
        --device cuda --seeds "${SEEDS:-0}" $RECIPE --json "$OUT/acceptance-fp8-seed${SEEDS:-0}.json" 2>&1 \
        | tee "$OUT/acceptance-fp8-seed${SEEDS:-0}.log" \
        | grep -v "^\(INFO\|DEBUG\)" ;;
peer)
    [ -d /tmp/m8b ] || python3 /tmp/kit/make_model.py /tmp/m8b >/dev/null
    python3 bench/peer_speed.py /tmp/m8b /tmp/peer --prompts 128 --prompt-len 2048 --layer-ids 2,16,29,32 \
        --dtype bfloat16 --json "$OUT/peer_speed.json" 2>&1 | tail -5; cp /tmp/peer/peer.stderr.log "$OUT/" 2>/dev/null ;;
*) echo "unknown stage $1"; exit 2 ;;
esac
