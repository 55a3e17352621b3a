#!/bin/bash
# Alternating before (942403e, /work/before31) / after (this branch, snapshot in /tmp/after5) runs of the bench.
out=$(cd "$(dirname "$0")" && pwd)
for k in 1 2; do
  for side in before after; do
    if [ $side = before ]; then co=/work/before31; else co=/tmp/after5; fi
    echo "== $side run $k $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $co && python3 scripts/bench_checkpoint.py --modes composable_shard,composable_shard_direct,composable_shard_safe \
      --repeats 8 --rounds 4 --json $out/ck_${side}_$k.json 2>&1 | tail -5)
  done
done
echo "== done $(date -u +%H:%M:%S)"
