#!/usr/bin/env bash
# The grid of issue 34 item 3's runtime model (2 ranks, torch 2.13 CPU, glibc
# defaults): each point is benchmarks/runtime_2026-11-25/measure_runtime.py
# (scripts/bench.py's memory pass with /proc and mallinfo2 snapshots) through
# shared memory (the CPU default) and through gloo. Usage, repository root:
#   bash benchmarks/runtime_2026-11-25b/run_grid.sh [name ...]   (default: all)
set -u
cd "$(dirname "$0")/../.."
here=benchmarks/runtime_2026-11-25b
declare -A POINTS=(
  [w256_d8]="--config gpt"
  [w256_d2]="--config gpt --n-layer 2"
  [w256_d16]="--config gpt --n-layer 16"
  [w512_d8]="--config gpt --n-embd 512"
  [w768_d8]="--config gpt --n-embd 768 --n-head 12"
  [w1280_d4]="--config gpt --n-embd 1280 --n-head 16 --n-layer 4 --batch-size 2"
  [w326m]="--config gpt-326m"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(w256_d8 w256_d2 w256_d16 w512_d8 w768_d8 w1280_d4 w326m)
for name in "${names[@]}"; do
  for transport in shm gloo; do
    switch=1; [ "$transport" = gloo ] && switch=0
    out=$here/${name}_${transport}.json
    echo "== $name $transport: ${POINTS[$name]} ($(date -u +%H:%M:%S))"
    COMPOSABLE_SHARD_SHARED_MEMORY=$switch PYTHONPATH=$PWD python3 benchmarks/runtime_2026-11-25/measure_runtime.py \
      ${POINTS[$name]} --out "$out" 2>&1 | grep -v Warning | tee "${out%.json}.log"
  done
done
