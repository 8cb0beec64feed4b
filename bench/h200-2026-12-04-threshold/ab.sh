#!/usr/bin/env bash
# Does the fixed mmap threshold (kept_bytes.return_freed_memory, c5df69a) cost the Llama-8B shape's drain with
# nvcomp-ans? One machine, one process each: this checkout and .abtest/old (`git archive 7aa3db1 eagle_states`, the
# commit before it), nvcomp-ans alone, ROUNDS rounds each. From the checkout's root, vLLM from the kit installed.
source bench/h200_env.sh
mkdir -p "$OUT/new" "$OUT/old" && OUT=$(cd "$OUT" && pwd)
[ -d /dev/shm/m8b ] || python3 /tmp/kit/make_model.py /dev/shm/m8b >/dev/null
A="--model /dev/shm/m8b --out /tmp/bench --prompts 384 --prompt-len 2048 --rounds ${ROUNDS:-2} \
   --max-num-batched-tokens 16384 --max-num-seqs 64 --shard-max-tokens 32768 --write-threads 8 \
   --gpu-memory-utilization 0.85 --disk-probe-gb 8 --codecs nvcomp-ans"
for side in ${SIDES:-new old}; do
  dir=$PWD; [ $side = old ] && dir=$PWD/.abtest/old
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" python3 -m eagle_states bench $A --json "$OUT/$side/llama8b.json" \
      2>"$OUT/$side/llama8b.err" | tee "$OUT/$side/llama8b.txt" | grep -E "^round|ratio c|extra time|disk alone|peak")
done
