#!/bin/sh
set -e
cd "$(dirname "$0")/../.."
T=/tmp/ob/t-keyedv2-160
/usr/bin/time -f "make-demo-model %e s" nice -n 10 .venv/bin/eagle-states make-demo-model $T --train-steps 160 --recipe keyed
nice -n 10 .venv/bin/python bench/cpu-2026-12-02-acceptance/probe_target.py $T 160 keyed | grep -v Loading
/usr/bin/time -f "acceptance run %e s" bench/cpu-2026-12-02-offbyone/run_acc.sh $T /tmp/ob/acc-v2 1,4,7,8 2000 32 --controls token-shift,layer-off-by-one,layer-off-by-one-down --epochs 3 --max-steps 40
