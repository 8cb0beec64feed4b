#!/usr/bin/env bash
# The host path on the H200 (#29), one stage per device call (at most 10 minutes each):
#   [ROUNDS=N] [PROMPTS=N (DeepSeek-V3 stages, default 192)] [CODECS=... (rss)] bash bench/h200_host.sh check [CODECS]|codecs|disk|writer|gil|dsv3-disk [CODECS]|dsv3-shm [CODECS]|rss|waits|hugetmpfs|shm-huge [HUGE]|llama8b [CODECS]
# After BLAKE3 shard digests (a writer hashes 3.5 x faster than with sha256), and the peak RSS of the process tree
# against sample length (the 2026-12-02 run of `check` and `dsv3-disk` also had nvCOMP's scratch memory from torch's
# caching allocator, which made the forward passes slower still and was taken out: bench/RESULTS.md). Needs vLLM from
# ../shared/gpukit installed on the machine (/tmp/site) and the wheels in .whl-nvcomp/ (nvCOMP) and .whl/ (h200_env.sh).
# Results go to $OUT.
source bench/h200_env.sh
bench() {  # NAME ARGS...: one bench, its text and JSON in $OUT
  local name=$1; shift
  python3 -m eagle_states bench "$@" --json "$OUT/$name.json" 2>"$OUT/$name.err" | tee "$OUT/$name.txt" \
      | grep -v "^  capture \|^round"
  tail -2 "$OUT/$name.err"
}
memory_state() {  # this shell's memory cgroup (v2, else v1), the host's memory and its pressure stall
  local cg; cg=/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  [ -f "$cg/memory.max" ] || cg=/sys/fs/cgroup/memory
  for f in "$cg"/memory.{max,high,current,peak,events,pressure,usage_in_bytes,limit_in_bytes,failcnt} \
      /proc/pressure/memory /sys/kernel/mm/transparent_hugepage/shmem_enabled; do
    [ -r "$f" ] && sed "s|^|$(basename "$f"): |" "$f"
  done
  [ -r "$cg/memory.stat" ] && grep -E "^(anon|file|shmem|pgscan|pgsteal|workingset_refault|thp)" "$cg/memory.stat"
  grep -E "^(MemTotal|MemFree|MemAvailable|Shmem|Mlocked|Dirty|Writeback):" /proc/meminfo
  df -h /dev/shm | tail -1; grep -w /dev/shm /proc/mounts
}
case "$1" in
  check)  # CODECS: default nvcomp-ans,fp8-e4m3-ans
    set -- check "${2:-nvcomp-ans,fp8-e4m3-ans}"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import blake3, psutil; from nvidia import nvcomp; print('blake3', blake3.__version__, 'nvcomp', \
nvcomp.__version__, 'CudaStream:', [a for a in dir(nvcomp.CudaStream) if not a.startswith('__')])"
    for codec in ${2//,/ }; do  # an extraction with each codec against a plain one (bench/gpu_check.py)
      python3 bench/gpu_check.py /tmp/gc-$codec --only llama --codec $codec >"$OUT/gpu_check_$codec.log" 2>&1
      echo "gpu_check $codec: exit $?"; grep -E "PASS|FAIL|Error|error" "$OUT/gpu_check_$codec.log" | tail -4
    done ;;
  codecs)  # the step codecs alone: a step encoded, written, read back (bench/gpu_codec_check.py)
    python3 bench/gpu_codec_check.py 2>&1 | tee "$OUT/gpu_codec_check.txt" | tail -5 ;;
  writer)  # the shard writer against the disk alone, nothing of the capture running (bench/writer_check.py); then
           # into /dev/shm, where the disk does not hide it, a step codec's shard framed a state or a sample at a time
    python3 bench/writer_check.py /tmp/writer-check --samples 16 2>&1 | tee "$OUT/writer_check.txt"
    for codec in nvcomp-ans fp8-e4m3; do
      python3 bench/writer_check.py /dev/shm/writer-check --samples 16 --rounds 3 --framed $codec 2>&1 \
          | tee "$OUT/writer_check_shm_$codec.txt" | grep FRAMED
    done
    rm -rf /tmp/writer-check /dev/shm/writer-check ;;
  disk)  # /dev/shm written buffered, as shards are now, and through O_DIRECT, as they were
    python3 bench/disk_check.py /dev/shm/disk-check 4 2>&1 | tee "$OUT/disk_check_shm.txt"; rm -rf /dev/shm/disk-check ;;
  dsv3-disk)
    make_dsv3
    bench dsv3-disk --model /dev/shm/dsv3 --out /tmp/bench $DSV3 --rounds ${ROUNDS:-2} --codecs ${2:-none,nvcomp-ans,fp8-e4m3} ;;
  gil)  # does nvCOMP's host API stop the forward thread's kernel launches while it waits? (bench/RESULTS.md)
    python3 bench/nvcomp_gil_check.py 2>&1 | tee "$OUT/nvcomp_gil_check.txt"
    python3 bench/framing_gil_check.py 2>&1 | tee "$OUT/framing_gil_check.txt" ;;
  dsv3-shm)
    make_dsv3
    bench dsv3-shm --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 --shard-max-tokens 16384 --rounds ${ROUNDS:-2} \
        --codecs ${2:-none} ;;
  rss)  # the same tokens per round (393,216) in samples of 4K, 16K and 64K tokens (${2:-all three}, PROMPTS:LENGTH[:GiB
        # of host buffer, 8 by default]; 6:65536:2 spills the samples: 3.76 GB each), CODECS=... (none), SPILL_DIR=...
        # (beside the shards; /dev/shm/spill takes the spilled bytes off the disk); the demo
        # model says 8,192 positions: a copy saying 131,072 (random weights: RoPE runs at any position)
    make_dsv3
    if [ ! -d /dev/shm/dsv3-long ]; then
      cp -al /dev/shm/dsv3 /dev/shm/dsv3-long && rm /dev/shm/dsv3-long/config.json  # hard links: regular files
      python3 -c "import json; c = json.load(open('/dev/shm/dsv3/config.json')); c['max_position_embeddings'] = 131072; \
json.dump(c, open('/dev/shm/dsv3-long/config.json', 'w'))"
    fi
    for spec in ${2:-96:4096 24:16384 6:65536}; do
      IFS=: read -r prompts length gib <<< "$spec"
      bench "rss-$length${gib:+-$gib}" --model /dev/shm/dsv3-long --out /tmp/bench $COMMON --disk-probe-gb 1 \
          --prompts "$prompts" --prompt-len "$length" --host-buffer-gb "${gib:-8}" --rounds 1 --codecs ${CODECS:-none} \
          ${SPILL_DIR:+--spill-dir "$SPILL_DIR"}
    done ;;
  waits)  # into RAM uncompressed, one round (ROUNDS=), with where the writers' threads sleep (bench/thread_waits.py): the
          # shard's write calls run at 1.45 GB/s with their threads mostly off the CPU (RESULTS, 2026-12-04, thirteenth)
    # and the memory cgroup's limits and events before and after: a cgroup past memory.high has its allocating
    # threads put to sleep, and tmpfs pages count against it
    make_dsv3
    memory_state > "$OUT/memory_before.txt"
    PYTHONPATH="$PWD/bench/thread_names:$PYTHONPATH" python3 bench/thread_waits.py --only "" \
        "$OUT/thread_waits.txt" -- python3 -m eagle_states bench --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 \
        --shard-max-tokens 16384 --rounds ${ROUNDS:-1} --codecs none --json "$OUT/waits.json" 2>"$OUT/waits.err" \
        | tee "$OUT/waits.txt" | grep "writer thread's time\|ratio"
    memory_state > "$OUT/memory_after.txt"
    cat "$OUT/thread_waits.txt"; diff "$OUT/memory_before.txt" "$OUT/memory_after.txt" | grep "^[<>]" | head -60
    true ;;  # files that differ are no failure
  hugetmpfs)  # tmpfs with huge pages against /dev/shm as mounted: the shard writer alone (bench/huge_tmpfs_check.py),
              # then the into-RAM capture into each, one process each (plain prefill beside it in both)
    python3 bench/huge_tmpfs_check.py 2>&1 | tee "$OUT/huge_tmpfs_check.txt" | grep "^TMPFS\|cannot"
    # and whether tmpfs's page allocation can be taken off the writes' path (on the CPU machine: no, end to end)
    python3 bench/tmpfs_fallocate_check.py /dev/shm --gb 4 2>&1 | tee "$OUT/fallocate_check.txt"
    make_dsv3
    bench dsv3-shm --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 --shard-max-tokens 16384 --rounds ${ROUNDS:-2} \
        --codecs none
    mkdir -p /mnt/huge
    if mount -t tmpfs -o size=48G,huge=always tmpfs /mnt/huge; then  # else nothing: /mnt is the machine's disk
      bench dsv3-huge --model /dev/shm/dsv3 --out /mnt/huge/bench $DSV3 --shard-max-tokens 16384 \
          --rounds ${ROUNDS:-2} --codecs none
      umount /mnt/huge
    fi
    grep -w /dev/shm /proc/mounts ;;
  shm-huge)  # into /dev/shm as mounted, remounted with ${2:-huge=within_size} (what the bench advises), then as
             # mounted again: one process each, plain prefill beside each; /dev/shm is left as it was
    make_dsv3
    was=$(awk '$2 == "/dev/shm" {print $4}' /proc/mounts | tail -1 | tr , '\n' | grep "^huge=" || echo huge=never)
    n=0
    for huge in "$was" "${2:-huge=within_size}" "$was"; do
      mount -o "remount,$huge" /dev/shm || break
      bench "shm-$((++n))-${huge#huge=}" --model /dev/shm/dsv3 --out /dev/shm/bench $DSV3 --shard-max-tokens 16384 \
          --rounds ${ROUNDS:-2} --codecs none
    done
    mount -o "remount,$was" /dev/shm ;;
  llama8b)
    [ -d /dev/shm/m8b ] || python3 /tmp/kit/make_model.py /dev/shm/m8b >/dev/null
    bench llama8b-disk --model /dev/shm/m8b --out /tmp/bench --prompts 384 --prompt-len 2048 --rounds ${ROUNDS:-2} \
        --max-num-batched-tokens 16384 --max-num-seqs 64 --shard-max-tokens 32768 --write-threads 8 \
        --gpu-memory-utilization 0.85 --disk-probe-gb 8 --codecs ${2:-none,nvcomp-ans} ;;
esac
