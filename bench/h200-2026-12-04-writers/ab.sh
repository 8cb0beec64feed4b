#!/usr/bin/env bash
# extract.write_threads 4 against 8 (the default since this session), one process each on one machine: the
# DeepSeek-V3 width to the disk, uncompressed (the shape where the writers and the disk are the bound). From the
# checkout's root, vLLM from the kit installed; results in $OUT.
source bench/h200_env.sh
make_dsv3
for w in ${WRITERS:-4 8}; do
  python3 -m eagle_states bench --model /dev/shm/dsv3 --out /tmp/bench $DSV3 --write-threads $w --rounds 2 \
      --codecs none --json "$OUT/w$w.json" 2>"$OUT/w$w.err" | tee "$OUT/w$w.txt" | grep -E "ratio c|written|disk alone"
done
