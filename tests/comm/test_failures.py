"""A peer that dies or stops, on both CPU transports (shared memory, and gloo
with ``COMPOSABLE_SHARD_SHARED_MEMORY=0``): real 2-rank jobs in fresh
processes (``fault_job.py``, forked from a forkserver that imported torch
once; a killed rank cannot be a warm harness worker)
whose rank 1 is killed with SIGKILL while the group sets up, inside a
forward all-gather and inside a backward reduction, before a NO_SHARD
all-reduce through shared memory, before the owner step's all-to-all
through shared memory, instead of publishing a step's shards, instead of
closing a step's publish (where its peer waits before changing its
shards), in the middle of a collective streamed
through slots smaller than it, or stopped with SIGSTOP
(alive, stuck: only the group's timeout can end the wait). The survivor
must exit with an error naming a communication failure, soon after a death
and at the group's timeout after a stop, and leave no file in ``/dev/shm``.
Two clean jobs run at the same time as the faulty ones, on the same host:
both train in parity.

Every job is started at once, by one module fixture (about a minute on two
busy cores, instead of one job after another); each test reads its results.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from tests.support import fault_job
from tests.support.ports import free_ports
# The group's timeout in every job (init_process_group's ``timeout``).
_GROUP_TIMEOUT_S = 12.0
# A dead peer must be noticed well before the group's timeout through shared
# memory (about a second; the bound leaves room for a loaded machine), and
# through gloo within the timeout plus a few seconds (what gloo promises:
# measured 0.04-5 s here, at setup the slowest).
_DEATH_NOTICED_S = {"shared memory": 5.0, "gloo": _GROUP_TIMEOUT_S + 5.0}
# The survivor's process must have ended within the group's timeout and
# this after the fault (forked ranks end without the interpreter's
# shutdown: measured within 1.2 s of the error).
_EXIT_AFTER_ERROR_S = 5.0
_JOB_DEADLINE_S = 300.0
_FAULTS = ("setup", "forward", "backward", "stop")
_TRANSPORTS = {"shared memory": "1", "gloo": "0"}
_COMMUNICATION_FAILURE = re.compile(
    r"communication (failure|timeout)|Connection (closed|reset) by peer|Timed out|timed out", re.IGNORECASE
)


@dataclasses.dataclass
class _Job:
    name: str
    fault: str
    switch: str
    ranks: list[BaseProcess]
    out_dir: Path
    rank0_exit: float | None = None

    def text(self, rank: int) -> str:
        return "".join((self.out_dir / f"rank{rank}.{kind}").read_text(errors="replace") for kind in ("out", "err"))

    def stamp(self, rank: int, label: str) -> float | None:
        found = re.search(rf"^{label} ([0-9.]+)$", self.text(rank), re.MULTILINE)
        return float(found.group(1)) if found else None

    def error(self) -> str:
        found = re.search(r"^ERROR (.*)$", self.text(0), re.MULTILINE)
        return found.group(1) if found else ""

    def files_left(self) -> list[str]:
        prefix = f"composable_shard_{self.ranks[0].pid}_"
        return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]

    def describe(self) -> str:
        return f"{self.name}: rank 0 said\n{self.text(0)[-3000:]}\nrank 1 said\n{self.text(1)[-1500:]}"


def _start(context: multiprocessing.context.BaseContext, name: str, fault: str, switch: str, port: int, out_dir: Path) -> _Job:
    out_dir.mkdir(parents=True)
    ranks = []
    for rank in range(2):
        for kind in ("out", "err"):
            (out_dir / f"rank{rank}.{kind}").touch()
        args = (rank, 2, port, fault, _GROUP_TIMEOUT_S, switch, str(out_dir))
        process = context.Process(target=fault_job.run, args=args, name=f"{name}, rank {rank}")
        process.start()
        ranks.append(process)
    return _Job(name, fault, switch, ranks, out_dir)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Job]:
    """Every job of this module, run at once; rank 1 is killed once rank 0
    has exited (a stopped rank never exits by itself)."""
    plan = [(f"{transport}, {fault}", fault, switch) for transport, switch in _TRANSPORTS.items() for fault in _FAULTS]
    plan += [("shared memory, stream", "stream", "1"), ("shared memory, all_reduce", "all_reduce", "1")]
    plan += [("shared memory, all_to_all", "all_to_all", "1"), ("shared memory, publish", "publish", "1")]
    plan += [("shared memory, close", "close", "1")]
    plan += [(f"clean job {index}", "none", "1") for index in (1, 2)]
    root = tmp_path_factory.mktemp("fault_jobs")
    # Forked from one process that imported torch and the job once (a fresh
    # interpreter per rank would cost seconds of CPU each); without threads,
    # unlike this one.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.support.fault_job"])
    started = {
        name: _start(context, name, fault, switch, port, root / re.sub(r"\W+", "_", name))
        for (name, fault, switch), port in zip(plan, free_ports(len(plan)))
    }
    deadline = time.time() + _JOB_DEADLINE_S
    try:
        while time.time() < deadline and any(job.rank0_exit is None for job in started.values()):
            for job in started.values():
                if job.rank0_exit is None and job.ranks[0].exitcode is not None:
                    job.rank0_exit = time.time()
            time.sleep(0.1)
    finally:
        for job in started.values():
            for process in job.ranks:
                if process.exitcode is None:
                    process.kill()  # a stopped rank 1, or a job past the deadline
                process.join()
    print(_time_to_error_table(started))  # shown with pytest -s
    return started


def _time_to_error_table(jobs: dict[str, _Job]) -> str:
    """Seconds from rank 1's fault to rank 0's error, per fault and transport."""
    lines = [f"{'fault':<10}" + "".join(f"{transport:>16}" for transport in _TRANSPORTS)]
    for fault in _FAULTS:
        cells = []
        for transport in _TRANSPORTS:
            job = jobs[f"{transport}, {fault}"]
            fault_at, error_at = job.stamp(1, "FAULT_AT"), job.stamp(0, "ERROR_AT")
            exit_s = f"{job.rank0_exit - fault_at:.1f}" if fault_at and job.rank0_exit else "-"
            cells.append(f"{error_at - fault_at:>8.2f} ({exit_s:>4})" if fault_at and error_at else f"{'-':>16}")
        lines.append(f"{fault:<10}" + "".join(cells))
    return (
        f"\nseconds from rank 1's fault to rank 0's error (to rank 0's exit), group timeout {_GROUP_TIMEOUT_S:g} s\n"
        + "\n".join(lines)
    )


@pytest.mark.parametrize("transport", list(_TRANSPORTS))
@pytest.mark.parametrize("fault", ["setup", "forward", "backward"])
def test_survivor_of_a_killed_peer_fails_fast_naming_a_communication_failure(
    jobs: dict[str, _Job], transport: str, fault: str
) -> None:
    _check_survivor_of_a_kill(jobs[f"{transport}, {fault}"], transport)


def _check_survivor_of_a_kill(job: _Job, transport: str) -> None:
    assert job.rank0_exit is not None, f"rank 0 still waits after {_JOB_DEADLINE_S} s: {job.describe()}"
    assert job.ranks[1].exitcode == -signal.SIGKILL, job.describe()
    assert job.ranks[0].exitcode not in (0, None), job.describe()
    fault_at, error_at = job.stamp(1, "FAULT_AT"), job.stamp(0, "ERROR_AT")
    assert fault_at is not None and error_at is not None, job.describe()
    assert _COMMUNICATION_FAILURE.search(job.error()), job.describe()
    assert error_at - fault_at < _DEATH_NOTICED_S[transport], f"noticed after {error_at - fault_at:.2f} s: {job.describe()}"
    assert job.rank0_exit - fault_at < _GROUP_TIMEOUT_S + _EXIT_AFTER_ERROR_S, job.describe()
    assert job.files_left() == [], "the job's files stay in /dev/shm"


@pytest.mark.parametrize("transport", list(_TRANSPORTS))
def test_survivor_of_a_stopped_peer_fails_at_the_groups_timeout(jobs: dict[str, _Job], transport: str) -> None:
    job = jobs[f"{transport}, stop"]
    assert job.rank0_exit is not None, f"rank 0 still waits after {_JOB_DEADLINE_S} s: {job.describe()}"
    assert job.ranks[0].exitcode not in (0, None), job.describe()
    fault_at, error_at = job.stamp(1, "FAULT_AT"), job.stamp(0, "ERROR_AT")
    assert fault_at is not None and error_at is not None, job.describe()
    assert _COMMUNICATION_FAILURE.search(job.error()), job.describe()
    waited = error_at - fault_at
    assert _GROUP_TIMEOUT_S - 1.0 < waited < _GROUP_TIMEOUT_S + 5.0, f"{waited:.2f} s: {job.describe()}"
    assert job.files_left() == [], "the job's files stay in /dev/shm"


def test_survivor_of_a_peer_killed_in_the_middle_of_a_streamed_collective_fails_fast(jobs: dict[str, _Job]) -> None:
    """Rank 1 dies after publishing some rounds of a collective larger than
    its slots: rank 0, streaming the same collective, notices at once."""
    job = jobs["shared memory, stream"]
    _check_survivor_of_a_kill(job, "shared memory")
    assert "shared-memory" in job.error(), job.describe()


def test_survivor_of_a_peer_killed_before_a_shared_memory_all_reduce_fails_fast(jobs: dict[str, _Job]) -> None:
    """NO_SHARD: rank 1 dies instead of issuing a bucket's all-reduce; rank
    0, waiting for its rounds in shared memory, notices at once."""
    job = jobs["shared memory, all_reduce"]
    _check_survivor_of_a_kill(job, "shared memory")
    assert "all-reduce" in job.error(), job.describe()


def test_survivor_of_a_peer_killed_before_a_shared_memory_all_to_all_fails_fast(jobs: dict[str, _Job]) -> None:
    """A whole-parameter optimizer: rank 1 dies instead of issuing the owner
    step's all-to-all; rank 0, waiting for its first round in shared
    memory, notices at once, its error naming the all-to-all."""
    job = jobs["shared memory, all_to_all"]
    _check_survivor_of_a_kill(job, "shared memory")
    assert "all-to-all" in job.error(), job.describe()


def test_survivor_of_a_peer_killed_before_publishing_its_shards_fails_fast(jobs: dict[str, _Job]) -> None:
    """Rank 1 dies instead of publishing step 2's shards at the root's
    forward; rank 0, waiting for every rank to arrive at the publish,
    notices at once, its error naming the publish."""
    job = jobs["shared memory, publish"]
    _check_survivor_of_a_kill(job, "shared memory")
    assert re.search(r"publish \d+ of shards", job.error()), job.describe()


def test_survivor_of_a_peer_killed_before_closing_its_step_fails_fast(jobs: dict[str, _Job]) -> None:
    """Rank 1 dies at the end of step 2's backward instead of closing its
    publish; rank 0, waiting there until every peer read its shards (which
    live in its area), notices at once, its error naming the close."""
    job = jobs["shared memory, close"]
    _check_survivor_of_a_kill(job, "shared memory")
    assert re.search(r"close of publish \d+ of shards", job.error()), job.describe()


def test_two_jobs_on_one_host_at_the_same_time_both_train_in_parity(jobs: dict[str, _Job]) -> None:
    for index in (1, 2):
        job = jobs[f"clean job {index}"]
        assert job.ranks[0].exitcode == 0 and job.ranks[1].exitcode == 0, job.describe()
        assert "TRAINED" in job.text(0) and "TRAINED" in job.text(1), job.describe()
        assert job.files_left() == []
