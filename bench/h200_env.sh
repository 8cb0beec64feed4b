# Sourced by the H200 stage scripts (bench/h200_*.sh): vLLM from ../shared/gpukit (installed in /tmp/site), the
# wheels of .whl/ beside it once, this checkout on the path, results in $OUT, and the DeepSeek-V3-width demo model.
set -uo pipefail
source /tmp/site/kit_env.sh
for wheels in .whl-nvcomp .whl; do  # nvCOMP's two (34 MB) and the rest travel in separate calls (64 MiB a call)
  if compgen -G "$wheels/*.whl" >/dev/null && [ ! -f "/tmp/site/.installed$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl && touch "/tmp/site/.installed$wheels"
  fi
done
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-/tmp/out}
COMMON="--layer-ids 1,2,3,4 --max-num-batched-tokens 16384 --max-num-seqs 64 --shard-max-tokens 32768
        --write-threads 8 --gpu-memory-utilization 0.8"
DSV3="$COMMON --disk-probe-gb 8 --prompts ${PROMPTS:-192} --prompt-len 2048"
make_dsv3() { [ -d /dev/shm/dsv3 ] || python3 -m eagle_states make-demo-model /dev/shm/dsv3 --arch deepseek-v3-real \
    --layers 4 --device cuda >/dev/null; }
