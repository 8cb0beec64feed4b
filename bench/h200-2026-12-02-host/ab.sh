source bench/h200_env.sh
make_dsv3
A="--model /dev/shm/dsv3 --out /dev/shm/bench $COMMON --shard-max-tokens 16384 --disk-probe-gb 8 --free-written --prompts 192 --prompt-len 2048 --rounds 2 --codecs none"
i=0
for which in blake3 sha256 blake3; do
  i=$((i+1)); P=$PWD; [ $which = sha256 ] && P=$PWD/.abtest/old
  PYTHONPATH=$P:$PYTHONPATH timeout 150 python3 -m eagle_states bench $A --json $OUT/ab-$i-$which.json 2>$OUT/ab-$i-$which.err > $OUT/ab-$i-$which.txt
  echo "== $i $which"; grep -E "ratio capture|extra time|written|RSS" $OUT/ab-$i-$which.txt
done
