"""Owns: one trial of the largest-model search (``--config largest``) — one
mode at one ``n_layer`` training ``--memory-steps`` steps in fresh
processes (one per rank, all in one process group of their own), the
watchdog in the parent that stops the trial before the machine runs out of
memory, and what the trial reports.

Knows nothing of: the search and its table (``largest.py``), how the modes
wrap the model (``peers.py``).

Run as ``python -m bench.trials ARGS_JSON RANK PORT OUT_DIR MODE`` (by
``run_trial`` only): one rank of one trial.

[Note: what a trial's memory is]
The watchdog needs a number it can read every few milliseconds: the
trial's ``usage`` is the sum over its ranks of ``RssAnon`` (private memory:
tensors, the allocator's heap) plus the largest ``RssShmem`` of a rank
(composable_shard's ``/dev/shm`` slots: every rank maps every rank's slots,
so the sum would count them once per rank), both from
``/proc/<pid>/status``, which costs no page-table walk. File pages (the
libraries' code) are left out: they were in the page cache before the trial
and are shared with the parent. A trial is stopped ("out of memory") when
its usage passes the budget, or when the machine's ``MemAvailable`` falls
below ``--memory-floor`` whatever the budget (other processes count too).
A rank killed by ``SIGKILL`` that the watchdog did not send is taken to be
the kernel's OOM killer; both mean "does not fit". After a trial that ran to
the end, its usage is the larger of the highest sample and each rank's
usage at the start plus its RSS high-water rise (``memory.py``'s peak): the
sampling may miss a short spike, the high-water mark does not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MB = 2**20
_POLL_S = 0.05
_SCRIPTS = Path(__file__).resolve().parents[1]  # scripts/: bench is importable from there


@dataclass
class TrialResult:
    """One trial. ``status``: ``"fits"``, ``"out of memory"`` (the
    watchdog stopped it, or the kernel killed a rank) or ``"error"`` (it
    failed for another reason: ``detail`` has the end of its output)."""

    mode: str
    n_layer: int
    status: str
    usage_bytes: int  # the trial's processes at their highest ([Note: what a trial's memory is])
    seconds: float
    detail: str = ""
    start_usage_bytes: list[int] = field(default_factory=list)  # per rank, before the model was built
    after_build_mb: float | None = None  # largest over ranks: RSS after building model and optimizer
    peak_rise_mb: float | None = None  # largest over ranks: RSS high-water rise (memory.py's peak)
    losses: list[float] = field(default_factory=list)  # mean over ranks, per step
    build_s: float | None = None  # slowest rank: building model and optimizer
    step_s: list[float] = field(default_factory=list)  # slowest rank, per step
    reached: str = ""  # how far the ranks got: "build", "step 1", ...
    samples: list = field(default_factory=list)  # --plot: rank 0's memory at every hook of its last step

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("bench: /proc/meminfo has no MemAvailable (Linux 3.14+ needed for --config largest)")


def process_usage(pid: int | str = "self") -> tuple[int, int]:
    """(RssAnon, RssShmem) of a process in bytes; (0, 0) once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kb = [int(fields.get(name, "0 kB").split()[0]) for name in ("RssAnon", "RssShmem")]
    return kb[0] * 1024, kb[1] * 1024


def trial_usage(pids: list[int]) -> int:
    usages = [process_usage(pid) for pid in pids]
    return sum(anon for anon, _ in usages) + max((shmem for _, shmem in usages), default=0)


# ---------------------------------------------------------------- parent side
def run_trial(
    args: argparse.Namespace, mode: str, n_layer: int, *, budget_bytes: int, floor_bytes: int, work_dir: str
) -> TrialResult:
    """Train ``mode`` with ``n_layer`` blocks in fresh processes while the
    watchdog watches; see [Note: what a trial's memory is]."""
    trial_dir = Path(work_dir, f"{mode}_{n_layer}_{time.monotonic_ns()}")
    trial_dir.mkdir(parents=True)
    args_file = trial_dir / "args.json"
    args_file.write_text(json.dumps({**vars(args), "n_layer": n_layer}))
    with socket.socket() as s:  # a free port for this trial's process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_SCRIPTS), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    for rank in range(args.world_size):
        command = [sys.executable, "-m", "bench.trials", str(args_file), str(rank), str(port), str(trial_dir), mode]
        log = open(trial_dir / f"rank{rank}.log", "wb")
        # Rank 0 leads a new process group; the others join it: one killpg stops the trial.
        group = 0 if rank == 0 else procs[0].pid
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=group))
        log.close()
    try:
        status, detail, sampled = _watch(procs, budget_bytes, floor_bytes, n_layer, args.trial_timeout, start)
    finally:  # Ctrl-C, or any error in the parent: the ranks go too (their own group gets no SIGINT)
        if any(p.poll() is None for p in procs):
            _stop(procs)
    return _result(args, mode, n_layer, trial_dir, status, detail, sampled, time.monotonic() - start, budget_bytes)


def _watch(
    procs: list[subprocess.Popen], budget: int, floor: int, n_layer: int, timeout_s: float, start: float
) -> tuple[str, str, int]:
    """Poll until every rank exits or the trial must stop; (status, detail,
    highest sampled usage)."""
    pids = [p.pid for p in procs]
    highest = 0
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            failed = [c for c in codes if c != 0]
            if not failed:
                return "fits", "", highest
            if -signal.SIGKILL in failed:
                return "out of memory", f"killed by the kernel (SIGKILL; OOM killer) at {n_layer} blocks", highest
            return "error", f"a rank exited with status {failed[0]}", highest
        usage = trial_usage(pids)
        highest = max(highest, usage)
        available = mem_available_bytes()
        reason = None
        if usage > budget:
            reason = ("out of memory", f"stopped: out of memory at {n_layer} blocks "
                      f"(trial used {usage / MB:,.0f} MB > budget {budget / MB:,.0f} MB)")
        elif available < floor:
            reason = ("out of memory", f"stopped: out of memory at {n_layer} blocks (machine MemAvailable "
                      f"{available / MB:,.0f} MB < floor {floor / MB:,.0f} MB; trial used {usage / MB:,.0f} MB)")
        elif any(code not in (None, 0) for code in codes):
            code = next(c for c in codes if c not in (None, 0))
            if code == -signal.SIGKILL:  # the other ranks would wait for it forever
                reason = ("out of memory", f"killed by the kernel (SIGKILL; OOM killer) at {n_layer} blocks")
            else:
                reason = ("error", f"a rank exited with status {code}")
        elif time.monotonic() - start > timeout_s:
            reason = ("error", f"timed out after {timeout_s:.0f} s (--trial-timeout)")
        if reason is not None:
            _stop(procs)
            return reason[0], reason[1], highest
        time.sleep(_POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the trial's process group (rank 0 leads it) and reap the ranks."""
    try:
        os.killpg(procs[0].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        p.wait()


def _result(
    args: argparse.Namespace, mode: str, n_layer: int, trial_dir: Path, status: str, detail: str,
    sampled: int, seconds: float, budget: int,
) -> TrialResult:
    records = [_read_json(trial_dir / f"rank{r}.json") for r in range(args.world_size)]
    starts = [_read_json(trial_dir / f"rank{r}.start.json") for r in range(args.world_size)]
    reached = [_read_json(trial_dir / f"rank{r}.progress.json").get("reached", "start") for r in range(args.world_size)]
    result = TrialResult(mode, n_layer, status, sampled, seconds, detail, reached=min(reached, key=_progress_order))
    if all(starts):
        result.start_usage_bytes = [s["usage_bytes"] for s in starts]
    if status == "fits" and all(records):
        result.after_build_mb = max(r["after_build_mb"] for r in records)
        result.peak_rise_mb = max(r["peak_increase_mb"] for r in records)
        result.losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in records))]
        result.build_s = max(r["build_s"] for r in records)
        result.step_s = [max(step) for step in zip(*(r["step_s"] for r in records))]
        result.samples = records[0].get("samples", [])
        from_marks = sum(s["usage_bytes"] + int(r["peak_increase_mb"] * MB) for s, r in zip(starts, records))
        result.usage_bytes = max(sampled, from_marks)
        if result.usage_bytes > budget:
            result.status = "out of memory"
            result.detail = (f"ran to the end but over budget at {n_layer} blocks: {result.usage_bytes / MB:,.0f} MB "
                             f"> {budget / MB:,.0f} MB (a spike between samples)")
    if status == "error":
        tails = [(trial_dir / f"rank{r}.log").read_text(errors="replace")[-2000:] for r in range(args.world_size)]
        result.detail += "\n" + "\n".join(f"--- rank {r} ---\n{t}" for r, t in enumerate(tails))
    return result


def _progress_order(reached: str) -> tuple[int, int]:
    if reached.startswith("step "):
        return 2, int(reached.split()[1])
    return (1, 0) if reached == "build" else (0, 0)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


# ---------------------------------------------------------------- rank side
def _progress(out_dir: Path, rank: int, reached: str) -> None:
    (out_dir / f"rank{rank}.progress.json").write_text(json.dumps({"reached": reached}))


def trial_worker(rank: int, args: argparse.Namespace, port: int, out_dir: Path, mode: str) -> None:
    import torch.distributed as dist
    from data import ByteCorpus

    from .memory import import_every_mode, memory_now, own_shared_memory_correction_mb, reset_peak_memory
    from .plot import recorded, recorder_for
    from .processes import init_worker
    from .training import barrier, build_run, next_batch, train_step

    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    import_every_mode()
    barrier(args, device)
    reset_peak_memory(device)
    start_mb, _ = memory_now(device)
    recorder, samples = recorder_for(args, mode, rank, device), []  # --plot
    (out_dir / f"rank{rank}.start.json").write_text(json.dumps({"usage_bytes": sum(process_usage())}))
    _progress(out_dir, rank, "build")
    started = time.perf_counter()
    run = build_run(mode, args, device)
    after_build_mb = memory_now(device)[0] - start_mb
    build_s, step_s = time.perf_counter() - started, []
    for step in range(args.memory_steps):
        _progress(out_dir, rank, f"step {step + 1}")
        started = time.perf_counter()
        with recorded(recorder, step == args.memory_steps - 1, samples):
            train_step(run, *next_batch(run, corpus, args, device), args, device)
        step_s.append(time.perf_counter() - started)
    peak_mb = memory_now(device)[1] - start_mb + own_shared_memory_correction_mb(mode, device)
    record = {
        "after_build_mb": after_build_mb,
        "peak_increase_mb": peak_mb,
        "losses": [float(loss) for loss in run.losses],
        "build_s": build_s,  # model and optimizer, this rank
        "step_s": step_s,  # each step, this rank
        "samples": samples,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    barrier(args, device)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    args_file, rank, port, out_dir, mode = argv
    args = argparse.Namespace(**json.loads(Path(args_file).read_text()))
    trial_worker(int(rank), args, int(port), Path(out_dir), mode)


if __name__ == "__main__":
    main(sys.argv[1:])
