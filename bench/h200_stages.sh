#!/usr/bin/env bash
# Several stages of bench/h200_host.sh in one device call, each into its own folder under a deadline for the whole
# call, the folders tarred into $OUT/stages.tgz after each stage: a call brings back at most 8 files, and a stage
# cut off at the deadline keeps what the stages before it wrote. A stage is its words for h200_host.sh, with
# VAR=value words first if it needs them:
#   DEADLINE=560 bash bench/h200_stages.sh hugetmpfs "rss 6:65536:2" "ROUNDS=1 waits"
set -uo pipefail
start=$(date +%s) deadline=${DEADLINE:-560} results=$(mktemp -d /tmp/stages.XXXX) n=0  # this call's stages only
mkdir -p "${OUT:=/tmp/out}"
for stage in "$@"; do
  n=$((n + 1)) vars=() args=()
  for word in $stage; do
    if [[ ${#args[@]} == 0 && $word =~ ^[A-Z_]+= ]]; then vars+=("$word"); else args+=("$word"); fi
  done
  name=$(IFS=-; echo "${args[*]}") left=$((deadline - ($(date +%s) - start)))
  dir="$results/$n-${name//:/-}"
  mkdir -p "$dir"
  if ((left < 30)); then echo "== $stage: not run, ${left} s left"; continue; fi
  echo "== $stage ($left s left)"
  # timeout signals the stage's whole process group: an engine's workers go with it
  timeout -k 10 "$left" env "${vars[@]}" OUT="$dir" bash bench/h200_host.sh "${args[@]}" 2>&1 | tee "$dir/stage.log"
  echo "== $stage: exit ${PIPESTATUS[0]} after $(($(date +%s) - start)) s"
  tar czf "$OUT/stages.tgz" -C "$results" .
done
