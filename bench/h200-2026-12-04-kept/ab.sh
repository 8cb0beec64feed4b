#!/usr/bin/env bash
# The kept compressed tensors' limit (dataset/kept_bytes.py), A/B on one machine: peak host RSS of a capture with
# nvcomp-ans at the DeepSeek-V3 width to the disk, which the writers wait for, with the limit (this checkout) and
# without (.abtest/old: `git archive` of the commit before it, eagle_states/ only; run from there: `python -m` puts
# the current directory first). From the checkout's root, vLLM from the kit installed; results in $OUT/{new,old}.
#   bash ab.sh rss      6 samples of 65,536 tokens (a shard each, 2.6 GB compressed), extract.host_buffer_gb 8
#   bash ab.sh shards   192 x 2,048 tokens in shards of 131,072 (5.2 GB compressed each), extract.host_buffer_gb 4
#                       (ran twice: new then old in shards-131072-a/, old then new in shards-131072-b/)
source bench/h200_env.sh
mkdir -p "$OUT/new" "$OUT/old" && OUT=$(cd "$OUT" && pwd)  # absolute: the old run works from .abtest/old
old() {  # NAME ARGS...: the bench on the old code, its text and JSON in $OUT/old
  local name=$1; shift
  (cd .abtest/old && PYTHONPATH="$PWD:$PYTHONPATH" python3 -m eagle_states bench "$@" --json "$OUT/old/$name.json" \
      2>"$OUT/old/$name.err" | tee "$OUT/old/$name.txt" | grep -E "ratio c|peak|disk alone")
}
case "${1:-rss}" in
  rss)
    CODECS=nvcomp-ans OUT="$OUT/new" bash bench/h200_host.sh rss 6:65536
    old rss-65536 --model /dev/shm/dsv3-long --out /tmp/bench $COMMON --disk-probe-gb 1 --prompts 6 \
        --prompt-len 65536 --rounds 1 --codecs nvcomp-ans ;;
  shards)
    make_dsv3
    A="--model /dev/shm/dsv3 --out /tmp/bench ${COMMON/--shard-max-tokens 32768/--shard-max-tokens 131072} \
       --host-buffer-gb 4 --disk-probe-gb 1 --prompts 192 --prompt-len 2048 --rounds 1 --codecs nvcomp-ans"
    python3 -m eagle_states bench $A --json "$OUT/new/big.json" 2>"$OUT/new/big.err" | tee "$OUT/new/big.txt" \
        | grep -E "ratio c|peak|disk alone"
    old big $A ;;
esac
