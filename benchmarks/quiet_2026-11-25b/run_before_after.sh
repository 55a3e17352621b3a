set -e
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
for i in 1 2 3 4 5 6; do
  for which in before main; do
    if [ $which = before ]; then D=/work/before31; else D=/work/main; fi
    echo "== $which run $i $(date +%T)"
    (cd $D && PYTHONPATH=$D python3 scripts/bench_checkpoint.py --modes composable_shard,composable_shard_direct --repeats 8 --rounds 4 --json $OUT/ck_${which}_$i.json 2>&1 | grep -v '^\[rank' | tail -12)
  done
done
