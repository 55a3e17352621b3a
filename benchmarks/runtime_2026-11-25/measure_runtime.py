"""What a rank's resident set holds beyond the plan's tensors (issue 34, item 3).

Runs scripts/bench.py's memory pass for composable_shard (same processes,
same baseline: after the process group, the corpus and every library's
import; glibc defaults) and snapshots /proc/self/status and glibc's
mallinfo2 before building, after building and after each step, so the
non-tensor part of the peak can be split by component. Usage (repository
root)::

    python benchmarks/runtime_2026-11-25/measure_runtime.py --config gpt --out gpt.json
    COMPOSABLE_SHARD_SHARED_MEMORY=0 python ... (gloo instead of shared memory)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "examples"), str(ROOT)]

import torch  # noqa: E402

from bench.cli import parse_args  # noqa: E402
from bench.largest import meta_gpt, plan_kwargs  # noqa: E402
from bench.memory import import_every_mode, own_shared_memory_correction_mb, reset_peak_memory  # noqa: E402
from bench.processes import init_worker, spawn  # noqa: E402
from bench.training import barrier, build_run, next_batch, synchronize, train_step  # noqa: E402
from data import ByteCorpus  # noqa: E402

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def snapshot() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {
        "rss": kib("VmRSS"), "hwm": kib("VmHWM"), "anon": kib("RssAnon"), "file": kib("RssFile"), "shmem": kib("RssShmem"),
        "threads": int(status["Threads"]), "malloc_in_use": (info.uordblks + info.hblkhd) / MIB,
        "malloc_free_kept": info.fordblks / MIB, "malloc_heap": (info.arena + info.hblkhd) / MIB,
    }


def worker(rank, args, port, out_dir):
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    import_every_mode()
    barrier(args, device)
    synchronize(device)
    reset_peak_memory(device)
    snaps = {"start": snapshot()}
    run = build_run("composable_shard", args, device)
    snaps["built"] = snapshot()
    for step in range(args.memory_steps):
        train_step(run, *next_batch(run, corpus, args, device), args, device)
        snaps[f"step{step}"] = snapshot()
    synchronize(device)
    correction = own_shared_memory_correction_mb("composable_shard", device)
    result = {"snaps": snaps, "shm_correction_mb": correction, "python_threads": threading.active_count(),
              "peak_increase_mb": snaps[f"step{args.memory_steps - 1}"]["hwm"] - snaps["start"]["rss"] + correction}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    barrier(args, device)
    torch.distributed.destroy_process_group()


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1]
    at = sys.argv.index("--out")
    argv = sys.argv[1:at] + sys.argv[at + 2 :]
    args = parse_args(argv + ["--modes", "composable_shard"])
    out_dir = Path(out).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn(worker, args, str(out_dir))
    write_record(out, out_dir, args, argv)


def write_record(out, out_dir, args, argv) -> None:
    """The ranks' files in ``out_dir`` with the current tree's plan, as JSON
    in ``out`` and one printed line per rank (rebuild_record.py of
    runtime_2026-11-25b calls it too)."""
    import composable_shard as cs

    planned = cs.plan(meta_gpt(args, args.n_layer), **plan_kwargs(args, activations=True))
    ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.nprocs)]
    Path(out).write_text(json.dumps({"argv": argv, "shared_memory": os.environ.get("COMPOSABLE_SHARD_SHARED_MEMORY", "1"),
                                      "plan_rank_bytes_mib": {k: v / MIB for k, v in planned.rank_bytes.items()},
                                      "peak_moment": planned.peak_moment, "ranks": ranks}, indent=1))
    for r, rank in enumerate(ranks):
        s, e = rank["snaps"]["start"], rank["snaps"][f"step{args.memory_steps - 1}"]
        tensors = (planned.rank_bytes["total"] - planned.rank_bytes.get("runtime", 0)) / MIB
        print(f"rank {r}: peak increase {rank['peak_increase_mb']:.1f} MiB, plan total {planned.rank_bytes['total'] / MIB:.1f} "
              f"(tensors {tensors:.1f}; non-tensor at peak {rank['peak_increase_mb'] - tensors:.1f}); at the end: "
              + ", ".join(f"{k} {e[k] - s[k]:+.1f}" for k in e))


if __name__ == "__main__":
    main()
