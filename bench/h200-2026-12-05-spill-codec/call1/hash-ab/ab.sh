# Run from the repository root with .abtest/ carried, after:
#   rm -rf .abtest/mt && mkdir -p .abtest/mt && git archive HEAD | tar -x -C .abtest/mt
#   sed -i 's/shard_hasher(every_core=self.codec.enabled)/shard_hasher(every_core=True)/' \
#       .abtest/mt/eagle_states/dataset/shard_file.py
# A/B/A into a tmpfs with huge pages (where a shard's writes no longer wait: 2026-12-05), DeepSeek-V3 width,
# uncompressed: each shard's stream hashed on every core (mt) or on its writer's thread (head, this checkout)
source bench/h200_env.sh; make_dsv3
mkdir -p /mnt/huge && mount -t tmpfs -o size=48G,huge=always tmpfs /mnt/huge || exit 1
n=0
for v in mt head mt; do
  n=$((n + 1)); P=$PWD; [ $v = mt ] && P=$PWD/.abtest/mt
  (cd $P && PYTHONPATH=$P:$PYTHONPATH python3 -m eagle_states bench --model /dev/shm/dsv3 --out /mnt/huge/bench $DSV3 \
      --shard-max-tokens 16384 --rounds 2 --codecs none --json $OUT/huge-$n-$v.json 2>$OUT/huge-$n-$v.err \
      > $OUT/huge-$n-$v.txt)
  echo "== $n $v"; grep -E "^  capture none|ratio capture|after the last forward pass" $OUT/huge-$n-$v.txt | cut -c1-330
done
umount /mnt/huge
