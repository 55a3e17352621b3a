"""Rebuild a measure_runtime.py record (JSON and the printed lines) from its
ranks' files, replanned with the current tree: w326m_shm's parent failed
at its plan step on a half-edited tree after the ranks had written theirs.
Usage: python rebuild_record.py OUT.json SWITCH(1|0) BENCH-ARGS..."""
import json, os, sys
from pathlib import Path
ROOT = Path.cwd()
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "examples"), str(ROOT)]
import composable_shard as cs
from bench.cli import parse_args
from bench.largest import meta_gpt, plan_kwargs
MIB = 2**20
out, switch, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
os.environ["COMPOSABLE_SHARD_SHARED_MEMORY"] = switch
args = parse_args(argv + ["--modes", "composable_shard"])
planned = cs.plan(meta_gpt(args, args.n_layer), **plan_kwargs(args, activations=True))
out_dir = Path(out).with_suffix("")
ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.nprocs)]
Path(out).write_text(json.dumps({"argv": argv, "shared_memory": switch,
    "plan_rank_bytes_mib": {k: v / MIB for k, v in planned.rank_bytes.items()},
    "peak_moment": planned.peak_moment, "ranks": ranks}, indent=1))
for r, rank in enumerate(ranks):
    s, e = rank["snaps"]["start"], rank["snaps"][f"step{args.memory_steps - 1}"]
    tensors = (planned.rank_bytes["total"] - planned.rank_bytes.get("runtime", 0)) / MIB
    print(f"rank {r}: peak increase {rank['peak_increase_mb']:.1f} MiB, plan total {planned.rank_bytes['total'] / MIB:.1f} "
          f"(tensors {tensors:.1f}; non-tensor at peak {rank['peak_increase_mb'] - tensors:.1f}); at the end: "
          + ", ".join(f"{k} {e[k] - s[k]:+.1f}" for k in e))
