"""Owns: ``bench.py runtime-memory``, the measurement behind the plan's
non-tensor line (composable_shard/planning/runtime_memory.py, [Note: the
memory that is not tensors]): a rank's peak beyond the plan's tensors,
split with ``/proc/self/status`` and glibc's ``mallinfo2``, and the fit of
that module's ``REST_BYTES`` / ``REST_PER_ACTIVATION_BYTE``.

Knows nothing of: how the plan computes its lines (it reads ``plan.runtime``
and ``plan.rank_bytes``).

Run (repository root; 2 ranks, CPU, glibc defaults)::

    python scripts/bench.py runtime-memory                          # the bench GPT (8 x 256), shared memory
    COMPOSABLE_SHARD_SHARED_MEMORY=0 python scripts/bench.py runtime-memory   # through gloo
    python scripts/bench.py runtime-memory --config gpt-326m --json w326m.json
    python scripts/bench.py runtime-memory --fit-rest               # REST_BYTES, REST_PER_ACTIVATION_BYTE

Every other argument is ``scripts/bench.py``'s (``--config``, ``--n-layer``,
``--n-embd``, ``--memory-steps`` ...). It runs that script's memory pass for
composable_shard (same processes, same baseline: after the process group,
the corpus and every library's import) and snapshots each rank before
building, after building and after each step. Per rank it prints the peak
(VmHWM growth over the level before building, as the bench measures it),
the plan's tensors and runtime line, and what the module's constants are
measured from:

- ``code`` (``CODE_BYTES``): ``RssFile`` growth over the steps;
- ``kept free`` (what ``heap_tops`` models): ``mallinfo2().fordblks`` growth;
- ``threads``: threads started after the baseline (0 expected);
- ``rest``: the peak less the plan's tensors, its ``code`` and its
  ``heap_tops``, which ``REST_BYTES + REST_PER_ACTIVATION_BYTE *
  activations`` models (the plan's activation peak, up to
  ``REST_ACTIVATION_CAP_BYTES``).

``--fit-rest`` runs the bench GPT at ``FIT_POINTS`` (width, blocks, heads,
batch; activation peaks of about 9 to 133 MiB, below the cap; about 7
minutes on 2 cores) through the current
transport and prints the least-squares line of their ``rest`` (mean over
ranks) against the plan's activation peak: the values of ``REST_BYTES``
and ``REST_PER_ACTIVATION_BYTE``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import torch

from .largest import meta_gpt, plan_kwargs
from .memory import import_every_mode, own_shared_memory_correction_mb, reset_peak_memory
from .processes import init_worker, spawn
from .training import barrier, build_run, next_batch, synchronize, train_step

MIB = 2**20
# (width, blocks, heads, global batch) of the points the rest is fitted on:
# activation peaks of about 9 to 133 MiB, below the cap.
FIT_POINTS = (
    (64, 4, 4, 8), (64, 16, 4, 8), (64, 32, 4, 8), (64, 64, 4, 8),
    (128, 2, 8, 8), (128, 8, 8, 8), (128, 16, 8, 8), (192, 2, 8, 8), (192, 16, 8, 8),
    (256, 2, 8, 8), (256, 8, 8, 8), (256, 16, 8, 8), (256, 8, 8, 16),
    (512, 2, 8, 8), (512, 8, 8, 8), (1280, 4, 16, 2),
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def snapshot() -> dict[str, float]:
    """This process's memory now: /proc/self/status (MiB) and mallinfo2."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())

    def mib(key: str) -> float:
        return int(status[key].split()[0]) / 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {
        "rss": mib("VmRSS"), "hwm": mib("VmHWM"), "anon": mib("RssAnon"), "file": mib("RssFile"),
        "shmem": mib("RssShmem"), "threads": int(status["Threads"]),
        "malloc_in_use": (info.uordblks + info.hblkhd) / MIB, "malloc_free_kept": info.fordblks / MIB,
    }


def _worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    from data import ByteCorpus  # examples/data.py

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
    last = snaps[f"step{args.memory_steps - 1}"]
    result = {"snaps": snaps, "shm_correction_mb": correction, "python_threads": threading.active_count(),
              "peak_increase_mb": last["hwm"] - snaps["start"]["rss"] + correction}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    barrier(args, device)
    torch.distributed.destroy_process_group()


def measure(args: argparse.Namespace) -> dict:
    """One point: every rank's snapshots and the plan of the same model."""
    import composable_shard as cs

    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as out_dir:
        spawn(_worker, args, out_dir)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.nprocs)]
    planned = cs.plan(meta_gpt(args, args.n_layer), **plan_kwargs(args, activations=True))
    runtime = planned.runtime
    tensors = (planned.rank_bytes["total"] - planned.rank_bytes.get("runtime", 0)) / MIB
    for rank in ranks:
        rank["rest_mb"] = rank["peak_increase_mb"] - tensors - (runtime.code + runtime.heap_tops) / MIB
    return {"n_layer": args.n_layer, "n_embd": args.n_embd, "units": len(planned.units),
            "activations_peak_mib": planned.rank_bytes["activations_peak"] / MIB,
            "plan_rank_bytes_mib": {k: v / MIB for k, v in planned.rank_bytes.items()},
            "plan_runtime_mib": {"code": runtime.code / MIB, "rest": runtime.rest / MIB,
                                 "heap_tops": runtime.heap_tops / MIB},
            "plan_tensors_mib": tensors, "ranks": ranks}


def print_point(point: dict, steps: int) -> None:
    plan, runtime = point["plan_rank_bytes_mib"], point["plan_runtime_mib"]
    print(f"GPT {point['n_layer']} x {point['n_embd']} ({point['units']} units): plan {plan['total']:.1f} MiB = "
          f"tensors {point['plan_tensors_mib']:.1f} + runtime {plan.get('runtime', 0.0):.1f} (code {runtime['code']:.1f}, "
          f"heap tops {runtime['heap_tops']:.1f}, rest {runtime['rest']:.1f})")
    for r, rank in enumerate(point["ranks"]):
        start, end = rank["snaps"]["start"], rank["snaps"][f"step{steps - 1}"]
        peak = rank["peak_increase_mb"]
        print(f"  rank {r}: measured peak {peak:.1f} MiB (plan {(plan['total'] - peak) / peak * 100:+.1f}%); "
              f"code {end['file'] - start['file']:+.1f}, kept free {end['malloc_free_kept'] - start['malloc_free_kept']:+.1f}, "
              f"threads {end['threads'] - start['threads']:+d}, rest {rank['rest_mb']:.1f}")


def main(argv: list[str] | None = None) -> int:
    from .cli import parse_args

    own = argparse.ArgumentParser(prog="bench.py runtime-memory", add_help=False)
    own.add_argument("--json", default=None, metavar="PATH", help="write every point's snapshots and plan as JSON")
    own.add_argument("--fit-rest", action="store_true", help=f"fit the rest on (width, blocks) {FIT_POINTS}")
    own.add_argument("-h", "--help", action="store_true")
    mine, rest = own.parse_known_args(argv)
    if mine.help:
        print(__doc__)
        return 0
    args = parse_args(rest + ["--modes", "composable_shard"])
    if args.device != "cpu" or args.simulated:
        sys.exit("bench.py runtime-memory: CPU with real ranks only (on CUDA the plan's runtime line is 0)")
    if args.memory_steps < 1:
        sys.exit("bench.py runtime-memory: --memory-steps must be at least 1")
    points = []
    sizes = FIT_POINTS if mine.fit_rest else ((args.n_embd, args.n_layer, args.n_head, args.batch_size),)
    for width, n_layer, n_head, batch_size in sizes:
        args.n_embd, args.n_layer, args.n_head, args.batch_size = width, n_layer, n_head, batch_size
        points.append(measure(args))
        print_point(points[-1], args.memory_steps)
    if mine.fit_rest:
        acts = [p["activations_peak_mib"] for p in points]
        rests = [statistics.mean(r["rest_mb"] for r in p["ranks"]) for p in points]
        slope, intercept = statistics.linear_regression(acts, rests)
        residuals = [rest - (intercept + slope * act) for act, rest in zip(acts, rests)]
        print(f"fit: REST_BYTES = {intercept:.2f} MiB, REST_PER_ACTIVATION_BYTE = {slope:.3f} "
              f"(composable_shard/planning/runtime_memory.py); measured rest less the line, per point: "
              + ", ".join(f"{r:+.1f}" for r in residuals) + " MiB")
    if mine.json:
        Path(mine.json).write_text(json.dumps(points, indent=1))
    return 0
