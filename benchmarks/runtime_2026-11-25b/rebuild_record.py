"""Rebuild a measure_runtime.py record (JSON and the printed lines) from its
ranks' files, replanned with the current tree: w326m_shm's parent failed
at its plan step on a half-edited tree after the ranks had written theirs.
Usage: python rebuild_record.py OUT.json SWITCH(1|0) BENCH-ARGS..."""
import os, sys
from pathlib import Path
ROOT = Path.cwd()
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "examples"), str(ROOT), str(ROOT / "benchmarks" / "runtime_2026-11-25")]
from bench.cli import parse_args
out, switch, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
os.environ["COMPOSABLE_SHARD_SHARED_MEMORY"] = switch
from measure_runtime import write_record  # noqa: E402
args = parse_args(argv + ["--modes", "composable_shard"])
write_record(out, Path(out).with_suffix(""), args, argv)
