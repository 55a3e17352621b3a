"""Files of a group whose every rank dies during its setup ([Note: stale
files] in comm/shared_memory/stale.py): two real 2-rank jobs, in a private
directory (``COMPOSABLE_SHARD_SHM_DIR``), paused in the setup window once
both ranks' files exist, then every rank killed, one job with SIGKILL and
one with SIGTERM (as the OOM killer, torchrun and Slurm do): their files
stay; the next job's setup removes them, and leaves the files of live or
unjudgeable makers. The sweep itself on files whose makers are known
(``sweep_stale_files``): a live process's kept, a dead, reused or zombie
pid's removed, another pid namespace's or boot's kept.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from composable_shard.comm.shared_memory import stale
from tests.support import setup_job
from tests.support.ports import free_ports

_KILLS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
_DEADLINE_S = 120.0
_TOKEN = "0123456789abcdef0123456789abcdef"


@dataclasses.dataclass
class _Job:
    ranks: list[BaseProcess]
    out_dir: Path

    def text(self, rank: int) -> str:
        return "".join((self.out_dir / f"rank{rank}.{kind}").read_text(errors="replace") for kind in ("out", "err"))

    def files(self, directory: Path) -> list[str]:
        prefix = f"composable_shard_{self.ranks[0].pid}_"
        return sorted(name for name in os.listdir(directory) if name.startswith(prefix))


def _start(
    context: multiprocessing.context.BaseContext, port: int, shm_dir: Path, pause_s: float, out_dir: Path
) -> _Job:
    out_dir.mkdir(parents=True)
    ranks = []
    for rank in range(2):
        process = context.Process(target=setup_job.run, args=(rank, 2, port, str(shm_dir), pause_s, str(out_dir)))
        process.start()
        ranks.append(process)
    return _Job(ranks, out_dir)


def _marker(pid: int, start: int, pidns: int | None = None, boot: str | None = None) -> str:
    own = stale.owner_marker().split(".")
    return f"{pid}.{start}.{pidns if pidns is not None else own[2]}.{boot if boot is not None else own[3]}"


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: no process has its pid (until reused, which the start time catches)
    return child.pid


def _decoys(directory: Path) -> dict[str, bool]:
    """Files a sweep must leave (False) or remove (True), by name."""
    own_pid, own_start = (int(part) for part in stale.owner_marker().split(".")[:2])
    dead = _dead_pid()
    decoys = {
        stale.file_name(1, _TOKEN, 0, _marker(own_pid, own_start)): False,  # a live job's file
        stale.file_name(1, _TOKEN, 1, _marker(own_pid, own_start + 1)): True,  # its pid reused
        stale.file_name(1, _TOKEN, 2, _marker(dead, 5)): True,  # its maker gone
        stale.file_name(1, _TOKEN, 3, _marker(dead, 5, pidns=1)): False,  # another pid namespace
        stale.file_name(1, _TOKEN, 4, _marker(dead, 5, boot="00000000")): False,  # another boot
        stale.file_name(dead, _TOKEN, 5, ""): False,  # the old form: no maker known
        "composable_shard_unrelated": False,
        "another_program": False,
    }
    for name in decoys:
        (directory / name).write_bytes(b"x")
    return decoys


@pytest.fixture(scope="module")
def killed_then_next(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two jobs killed in their setup, then the next job, all in one
    private directory; what each left there."""
    root = tmp_path_factory.mktemp("stale_files")
    shm_dir = root / "shm"
    shm_dir.mkdir()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.support.setup_job"])
    ports = free_ports(3)
    killed = {name: _start(context, port, shm_dir, 60.0, root / name) for name, port in zip(_KILLS, ports)}
    left_after_kill: dict[str, list[str]] = {}
    try:
        deadline = time.time() + _DEADLINE_S
        while time.time() < deadline and any(len(job.files(shm_dir)) < 2 for job in killed.values()):
            assert all(p.exitcode is None for job in killed.values() for p in job.ranks), "a job ended early"
            time.sleep(0.05)
        for name, job in killed.items():
            for process in job.ranks:
                os.kill(process.pid, _KILLS[name])  # every rank, in the window
        for name, job in killed.items():
            for process in job.ranks:
                process.join(30)
            left_after_kill[name] = job.files(shm_dir)
        exit_codes = {name: [p.exitcode for p in job.ranks] for name, job in killed.items()}
        decoys = _decoys(shm_dir)
        next_job = _start(context, ports[2], shm_dir, 0.0, root / "next")
        for process in next_job.ranks:
            process.join(_DEADLINE_S)
    finally:
        for job in [*killed.values(), *([next_job] if "next_job" in locals() else [])]:
            for process in job.ranks:
                if process.exitcode is None:
                    process.kill()
                    process.join()
    found = re.search(r"^LEFT (.*)$", next_job.text(0), re.MULTILINE)
    return {
        "killed": killed,
        "left_after_kill": left_after_kill,
        "exit_codes": exit_codes,
        "decoys": decoys,
        "next_job": next_job,
        "left_after_next_setup": json.loads(found.group(1)) if found else None,
        "left_at_end": sorted(os.listdir(shm_dir)),
    }


@pytest.mark.parametrize("kill", list(_KILLS))
def test_files_of_a_job_killed_in_setup_are_removed_by_the_next_jobs_setup(
    killed_then_next: dict[str, object], kill: str
) -> None:
    job = killed_then_next["killed"][kill]
    assert killed_then_next["exit_codes"][kill] == [-_KILLS[kill]] * 2, job.text(0) + job.text(1)
    left = killed_then_next["left_after_kill"][kill]
    assert len(left) == 2, f"the kill did not land in the setup window: {left}"
    next_job = killed_then_next["next_job"]
    listed = killed_then_next["left_after_next_setup"]
    assert listed is not None, next_job.text(0) + next_job.text(1)
    assert not set(left) & set(listed), f"still there after the next setup: {set(left) & set(listed)}"


def test_next_job_uses_shared_memory_and_leaves_only_files_it_cannot_judge(killed_then_next: dict[str, object]) -> None:
    next_job = killed_then_next["next_job"]
    assert [p.exitcode for p in next_job.ranks] == [0, 0], next_job.text(0) + next_job.text(1)
    assert "SHARED True" in next_job.text(0) and "SHARED True" in next_job.text(1)
    kept = sorted(name for name, removed in killed_then_next["decoys"].items() if not removed)
    assert killed_then_next["left_after_next_setup"] == kept
    assert killed_then_next["left_at_end"] == kept


def _stat_fields(pid: int) -> list[bytes]:
    """``/proc/<pid>/stat`` after the command name: the state first."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def _zombie() -> subprocess.Popen:
    """A child that exited and is not reaped yet (its pid still taken)."""
    child = subprocess.Popen(["true"])
    deadline = time.time() + 10
    while time.time() < deadline:
        if _stat_fields(child.pid)[0] == b"Z":
            return child
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_sweep_removes_only_files_whose_maker_is_provably_gone(tmp_path: Path) -> None:
    decoys = _decoys(tmp_path)
    zombie = _zombie()
    try:
        start = int(_stat_fields(zombie.pid)[19])
        name = stale.file_name(1, _TOKEN, 6, _marker(zombie.pid, start))
        (tmp_path / name).write_bytes(b"x")
        decoys[name] = True
        removed = stale.sweep_stale_files(str(tmp_path))
    finally:
        zombie.wait()
    assert sorted(removed) == sorted(name for name, gone in decoys.items() if gone)
    assert sorted(os.listdir(tmp_path)) == sorted(name for name, gone in decoys.items() if not gone)
    assert stale.sweep_stale_files(str(tmp_path)) == []
    assert stale.sweep_stale_files(str(tmp_path / "missing")) == []
