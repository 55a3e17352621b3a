"""Owns: the elastic tests' torchrun jobs of ``examples/train_gpt.py`` —
starting real torchrun agents (c10d rendezvous, restarts allowed) on a tiny
model, finding their workers' pids and ranks, killing them by pid, reading
rank 0's step log (when each step finished) and the run's checkpoints.

Knows nothing of: what the tests assert (tests/elastic/).

Every process here is started by the caller's test and ended by pid
(``Agent.stop``); nothing is killed by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_GPT = REPO_ROOT / "examples" / "train_gpt.py"
# A model and data small enough that the processes' start dominates.
TINY = (
    "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
    "--data-bytes", "50000", "--warmup-steps", "2", "--log-every", "1",
)  # fmt: skip
# Rendezvous settings that keep a restart quick: a dead agent is declared
# dead after 2 missed heartbeats of 1 s, and a round with fewer nodes than
# the most waits 1 s for more (torch's defaults: 5 s x 3, and 30 s).
FAST_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"
_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank0\] step +(\d+)/\d+ ")
_RESUMED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank0\] resumed from (\S+) at step (\d+)")
_FRESH_LINE = re.compile(r"\[rank0\] no complete checkpoint under ")


@dataclass
class Agent:
    """One torchrun agent ("node") and its log."""

    process: subprocess.Popen
    log: Path

    def workers(self) -> dict[int, int]:
        """This agent's live workers: global rank -> pid."""
        found = {}
        for pid in _children(self.process.pid):
            env = _environ(pid)
            if "RANK" in env and env.get("TORCHELASTIC_RUN_ID") is not None:
                found[int(env["RANK"])] = pid
        return found

    def stop(self) -> None:
        """SIGKILL the agent and its workers, by pid (only at the end of a test)."""
        if self.process.poll() is not None:
            return  # ended (and reaped): its pid may be another process's now
        for pid in [self.process.pid, *_children(self.process.pid)]:
            with _gone_is_fine():
                os.kill(pid, signal.SIGKILL)
        self.process.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_agent(
    *,
    name: str,
    tmp: Path,
    port: int,
    nnodes: str,
    nproc: int,
    save_dir: Path,
    steps: int,
    save_every: int,
    is_host: bool,
    shm_dir: Path,
    share_store: bool = True,
) -> Agent:
    """``torchrun --nnodes N --max-restarts 3 --rdzv-backend c10d
    --rdzv-endpoint 127.0.0.1:PORT --nproc_per_node P examples/train_gpt.py
    --save-dir D --save-every K --resume latest`` on the tiny model.
    ``share_store=False`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (every round a new store, hosted by worker rank 0)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",  # = torchrun, with this interpreter
        "--nnodes", nnodes, "--max-restarts", "3", "--monitor-interval", "0.1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
        "--rdzv-conf", f"{FAST_RDZV},is_host={int(is_host)}",
        "--nproc_per_node", str(nproc),
        str(TRAIN_GPT), *TINY,
        "--steps", str(steps), "--save-dir", str(save_dir), "--save-every", str(save_every), "--resume", "latest",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", COMPOSABLE_SHARD_SHM_DIR=str(shm_dir), PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's default: the agent shares its store
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    log = tmp / f"{name}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Agent(process=process, log=log)


def kill(pid: int) -> float:
    """SIGKILL ``pid``; returns when (``time.time()``)."""
    os.kill(pid, signal.SIGKILL)
    return time.time()


def wait_until(what: str, condition: Callable[[], object], agents: list[Agent], timeout_s: float, poll_s: float = 0.02) -> object:
    """Poll ``condition`` until it returns something true; fail naming
    ``what`` with the agents' logs after ``timeout_s`` or when an agent
    exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if any(agent.process.poll() is not None for agent in agents):
            value = condition()
            if value:
                return value
            break
        time.sleep(poll_s)
    codes = [agent.process.poll() for agent in agents]
    raise AssertionError(f"waiting for {what}: not within {timeout_s} s (agent exit codes {codes})\n{logs(agents)}")


def logs(agents: list[Agent]) -> str:
    return "\n".join(f"---- {agent.log.name} ----\n{agent.text()[-5000:]}" for agent in agents)


def _stamp(text: str) -> float:
    """A log line's asctime (local time, ms) as ``time.time()``."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def steps_logged(agent: Agent) -> list[tuple[float, int]]:
    """(when, step) of every step rank 0 logged, in order."""
    found = (_STEP_LINE.match(line) for line in agent.text().splitlines())
    return [(_stamp(m.group(1)), int(m.group(2))) for m in found if m]


def resumes_logged(agent: Agent) -> list[tuple[float, str, int]]:
    """(when, checkpoint name, step) of every resume rank 0 logged."""
    found = (_RESUMED_LINE.match(line) for line in agent.text().splitlines())
    return [(_stamp(m.group(1)), Path(m.group(2)).name, int(m.group(3))) for m in found if m]


def fresh_starts_logged(agent: Agent) -> int:
    return len(_FRESH_LINE.findall(agent.text()))


def first_step_after(agent: Agent, since: float) -> tuple[float, int] | None:
    return next(((when, step) for when, step in steps_logged(agent) if when >= since), None)


def complete_steps(save_dir: Path) -> list[int]:
    """The steps of the complete checkpoints (``step_NNNNNN``) on disk."""
    return sorted(int(p.name[5:]) for p in save_dir.glob("step_[0-9]*") if p.name[5:].isdigit())


def leftovers(save_dir: Path, shm_dir: Path) -> list[str]:
    """Checkpoint staging directories and shared-memory files still there."""
    staged = [p.name for p in save_dir.iterdir() if not p.name[5:].isdigit()] if save_dir.exists() else []
    return staged + [f"{shm_dir.name}/{name}" for name in os.listdir(shm_dir)]


def final_state(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor (model and optimizer) of a checkpoint, flattened by key."""
    from composable_shard.checkpoint import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out, everything=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=True))
    return flat


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            items = environ.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


class _gone_is_fine:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, value: BaseException | None, trace: object) -> bool:
        return kind is ProcessLookupError
