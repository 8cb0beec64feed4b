#!/usr/bin/env bash
# The step codecs on the H200 (#29), one stage per device call (each call is at most 10 minutes):
#   bash bench/h200_codecs.sh check|dsv3-disk|dsv3-shm|llama8b|after
# Needs vLLM from ../shared/gpukit installed on the machine (/tmp/site) and the wheels in .whl/ (nvCOMP's two,
# pandera, typeguard, py-spy). Results go to $OUT.
source bench/h200_env.sh
case "$1" in
  check)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 bench/gpu_codec_check.py 2>&1 | tee "$OUT/gpu_codec_check.txt"
    python3 bench/gpu_codec_check.py --layers 4 --rows 16384 --hidden 4096 2>&1 | tail -3 | tee -a "$OUT/gpu_codec_check.txt"
    for codec in nvcomp-ans fp8-e4m3; do
      python3 bench/gpu_check.py "/tmp/gc-$codec" --only llama --codec "$codec" >"$OUT/gpu_check_$codec.log" 2>&1
      echo "gpu_check $codec: exit $?"; grep -E "PASS|FAIL|Error|error" "$OUT/gpu_check_$codec.log" | tail -4
    done ;;
  dsv3-disk)
    make_dsv3
    python3 -m eagle_states bench --model /dev/shm/dsv3 --out /tmp/bench $DSV3 --rounds 2 \
        --codecs none,nvcomp-ans,fp8-e4m3 --json "$OUT/dsv3-disk.json" 2>"$OUT/dsv3-disk.err" | tee "$OUT/dsv3-disk.txt"
    tail -3 "$OUT/dsv3-disk.err" ;;
  dsv3-shm)
    make_dsv3
    # where the host path's time goes, into RAM: every thread of the engine process, sampled
    py-spy record --subprocesses --idle --format raw -r 25 -o "$OUT/dsv3-shm.pyspy" -- \
      python3 -m eagle_states bench --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 --rounds 2 \
        --codecs none,nvcomp-ans,fp8-e4m3 --json "$OUT/dsv3-shm.json" 2>"$OUT/dsv3-shm.err" | tee "$OUT/dsv3-shm.txt"
    tail -3 "$OUT/dsv3-shm.err" ;;
  llama8b)
    [ -d /dev/shm/m8b ] || python3 /tmp/kit/make_model.py /dev/shm/m8b >/dev/null
    python3 -m eagle_states bench --model /dev/shm/m8b --out /tmp/bench --prompts 384 --prompt-len 2048 --rounds 2 \
        --max-num-batched-tokens 16384 --max-num-seqs 64 --shard-max-tokens 32768 --write-threads 8 \
        --gpu-memory-utilization 0.85 --disk-probe-gb 8 --codecs none,nvcomp-ans \
        --json "$OUT/llama8b-disk.json" 2>"$OUT/llama8b-disk.err" | tee "$OUT/llama8b-disk.txt"
    tail -3 "$OUT/llama8b-disk.err" ;;
  after)  # nvcomp-ans encoded from the assembler thread: correctness, then both shapes, lossless only
    python3 bench/gpu_check.py /tmp/gc-after --only llama --codec nvcomp-ans >"$OUT/gpu_check_after.log" 2>&1
    echo "gpu_check nvcomp-ans: exit $?"; grep -E "PASS|FAIL" "$OUT/gpu_check_after.log" | tail -3
    make_dsv3
    python3 -m eagle_states bench --model /dev/shm/dsv3 --out /tmp/bench $DSV3 --rounds 2 --codecs none,nvcomp-ans \
        --json "$OUT/dsv3-after.json" 2>"$OUT/dsv3-after.err" | tee "$OUT/dsv3-after.txt" | grep -v "^  capture"
    [ -d /dev/shm/m8b ] || python3 /tmp/kit/make_model.py /dev/shm/m8b >/dev/null
    python3 -m eagle_states bench --model /dev/shm/m8b --out /tmp/bench --prompts 256 --prompt-len 2048 --rounds 1 \
        --max-num-batched-tokens 16384 --max-num-seqs 64 --shard-max-tokens 32768 --write-threads 8 \
        --gpu-memory-utilization 0.85 --disk-probe-gb 4 --codecs none,nvcomp-ans \
        --json "$OUT/llama8b-after.json" 2>"$OUT/llama8b-after.err" | tee "$OUT/llama8b-after.txt" | grep -v "^  capture" ;;
esac
