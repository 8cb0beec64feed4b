# Run from the repository root with .abtest/ carried, after:
#   mkdir -p .abtest/mt && git archive e7b480d | tar -x -C .abtest/mt
#   sed -i 's/shard_hasher(every_core=self.codec.enabled)/shard_hasher(every_core=True)/' \
#       .abtest/mt/eagle_states/dataset/shard_file.py
# A/B into RAM, DeepSeek-V3 width, uncompressed: the shard's stream hashed on one thread (HEAD) or on every core
source bench/h200_env.sh; make_dsv3
for v in mt head; do
  if [ $v = mt ]; then P=$PWD/.abtest/mt; else P=$PWD; fi
  (cd $P && PYTHONPATH=$P:$PYTHONPATH python3 -m eagle_states bench --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 \
      --shard-max-tokens 16384 --rounds 2 --codecs none --json $OUT/shm-$v.json 2>$OUT/shm-$v.err > $OUT/shm-$v.txt)
  echo "== $v"; grep -E "^  capture none|ratio capture|after the last forward pass|written" $OUT/shm-$v.txt | cut -c1-330
done
