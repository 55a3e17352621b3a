"""Surviving dead workers under torchrun's elastic agent: real ``torchrun``
agents (c10d rendezvous, ``--max-restarts 3``) run ``examples/train_gpt.py
--save-every K --resume latest`` on a tiny model; the test SIGKILLs a worker
mid-run, then (same run) another mid-save, and in a job of two agents
("nodes") kills one whole agent and starts it again. Every time the agent
restarts the group, every worker resumes from the newest complete
checkpoint, and the run ends with parameters and optimizer state bitwise
equal to an uninterrupted run of the same steps (the batch of a step
depends only on the step). No checkpoint staging directory or shared-memory
file is left behind. Measured: seconds from each kill to the first step
after the resume, and the steps lost beyond the newest complete checkpoint
(0); printed, and asserted within bounds.

Helpers: tests/support/torchrun_agents.py. Every process is started here and
ended by pid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.ports import free_ports
from tests.support.torchrun_agents import (
    Agent,
    complete_steps,
    final_state,
    first_step_after,
    fresh_starts_logged,
    kill,
    leftovers,
    logs,
    resumes_logged,
    start_agent,
    steps_logged,
    wait_until,
)

STEPS = 12
SAVE_EVERY = 4
TIMEOUT_S = 240.0  # a whole job, on two busy cores
RESUME_TIMEOUT_S = 120.0  # a kill to the first resumed step (measured 6-25 s on two busy cores)


def _job(tmp: Path, name: str) -> dict[str, Path]:
    paths = {"tmp": tmp / name, "save": tmp / name / "checkpoints", "shm": tmp / name / "shm"}
    paths["shm"].mkdir(parents=True)
    return paths


def _agent(
    paths: dict[str, Path], name: str, port: int, *, nnodes: str, nproc: int, is_host: bool = True, share_store: bool = True
) -> Agent:
    return start_agent(
        name=name, tmp=paths["tmp"], port=port, nnodes=nnodes, nproc=nproc, save_dir=paths["save"],
        steps=STEPS, save_every=SAVE_EVERY, is_host=is_host, shm_dir=paths["shm"], share_store=share_store,
    )  # fmt: skip


def _finish(agents: list[Agent], failed: bool) -> None:
    """Wait for the agents to end (at once, by pid, if the test failed)."""
    try:
        if failed:
            return
        codes = [agent.process.wait(timeout=TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:  # on failure, timeout or interruption: stop what we started
            if agent.process.poll() is None:
                agent.stop()
    assert codes == [0] * len(agents), f"torchrun exit codes {codes}\n{logs(agents)}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, torch.Tensor]]:
    """The uninterrupted run: 2 workers, same steps, same saves."""
    tmp = tmp_path_factory.mktemp("reference")
    paths = _job(tmp, "reference")
    (port,) = free_ports(1)
    agent = _agent(paths, "reference", port, nnodes="1:2", nproc=2)
    _finish([agent], failed=False)
    assert fresh_starts_logged(agent) == 1 and resumes_logged(agent) == [], logs([agent])
    assert complete_steps(paths["save"]) == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    yield final_state(paths["save"] / f"step_{STEPS:06d}", tmp / "reference.pt")


def _assert_same_as_reference(paths: dict[str, Path], reference: dict[str, torch.Tensor]) -> None:
    state = final_state(paths["save"] / f"step_{STEPS:06d}", paths["tmp"] / "final.pt")
    assert sorted(state) == sorted(reference)
    differing = [key for key in reference if not torch.equal(state[key], reference[key])]
    assert differing == [], f"tensors that differ from the uninterrupted run: {differing}"
    assert complete_steps(paths["save"]) == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    assert leftovers(paths["save"], paths["shm"]) == []


def _resumed_after(agent: Agent, since: float, agents: list[Agent]) -> tuple[str, int, float]:
    """(checkpoint, step) of the resume after ``since``, and seconds from
    ``since`` to the first step after it. That step is looked for after the
    resume's own line: the surviving rank 0 of the killed group can still
    log the step it had finished after ``since``."""

    def resumed() -> tuple[tuple[float, str, int], tuple[float, int]] | None:
        resumes = [r for r in resumes_logged(agent) if r[0] >= since]
        step = first_step_after(agent, resumes[0][0]) if resumes else None
        return (resumes[0], step) if step else None

    (_, name, step), (when, first) = wait_until("the resumed group's first step", resumed, agents, RESUME_TIMEOUT_S)  # type: ignore[misc]
    assert first == step + 1, (first, step)
    return name, step, when - since


def test_killed_worker_mid_run_then_mid_save_resumes_exactly(
    tmp_path: Path, reference: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _job(tmp_path, "one_node")
    (port,) = free_ports(1)
    agent = _agent(paths, "one_node", port, nnodes="1:2", nproc=2)
    agents, failed = [agent], True
    try:
        # 1. SIGKILL rank 1 between checkpoints (step 6 of 12 done; the newest is step 4).
        wait_until("step 6", lambda: any(step >= 6 for _, step in steps_logged(agent)), agents, TIMEOUT_S)
        first_pid = agent.workers()[1]
        killed_at = kill(first_pid)
        newest = complete_steps(paths["save"])[-1]
        name, step, seconds = _resumed_after(agent, killed_at, agents)
        assert (name, step) == (f"step_{newest:06d}", newest) == ("step_000004", 4), logs(agents)
        timings = [("mid-run, rank 1", seconds, newest - step)]

        # 2. The same run again: SIGKILL rank 0 while it saves step 8 (the newest complete is step 4).
        staging = paths["save"] / "step_000008.partial"
        wait_until("the save of step 8", staging.exists, agents, TIMEOUT_S, poll_s=0.002)
        workers = agent.workers()
        assert first_pid not in workers.values()
        killed_at = kill(workers[0])
        newest = complete_steps(paths["save"])[-1]
        name, step, seconds = _resumed_after(agent, killed_at, agents)
        assert (name, step) == (f"step_{newest:06d}", newest) == ("step_000004", 4), logs(agents)
        timings.append(("mid-save, rank 0", seconds, newest - step))
        failed = False
    finally:
        _finish(agents, failed)
    assert fresh_starts_logged(agent) == 1, logs(agents)
    _assert_same_as_reference(paths, reference)
    for what, seconds, lost in timings:
        assert lost == 0, (what, seconds, lost)
    with capsys.disabled():
        print("\n" + "\n".join(f"killed {what}: first resumed step {s:.2f} s after the kill, {lost} steps lost beyond "
                               f"the newest checkpoint" for what, s, lost in timings))


def test_two_agents_one_killed_whole_and_started_again_resumes_exactly(
    tmp_path: Path, reference: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two torchrun agents on this machine (c10d rendezvous, one worker
    each: the same world of 2 as the reference); node B, agent and worker,
    is SIGKILLed, then a new agent B' starts with the same command.

    With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every agent: torch 2.13's
    shared store cannot admit a replaced agent (B' waits for the round's
    MASTER_ADDR key, which the surviving rank-0 agent no longer writes, and
    both agents time out in the rendezvous; README's multi-node section)."""
    paths = _job(tmp_path, "two_nodes")
    (port,) = free_ports(1)
    node_a = _agent(paths, "node_a", port, nnodes="2", nproc=1, is_host=True, share_store=False)
    node_b = _agent(paths, "node_b", port, nnodes="2", nproc=1, is_host=False, share_store=False)
    agents, failed = [node_a, node_b], True
    try:
        both = agents

        def progressed() -> bool:
            return any(step >= 6 for agent in both for _, step in steps_logged(agent))

        wait_until("step 6", progressed, agents, TIMEOUT_S)
        pids = [node_b.process.pid, *node_b.workers().values()]
        assert len(pids) == 2
        killed_at = time.time()
        for pid in pids:
            kill(pid)
        node_b.process.wait()
        newest = complete_steps(paths["save"])[-1]
        node_b2 = _agent(paths, "node_b2", port, nnodes="2", nproc=1, is_host=False, share_store=False)
        agents = [node_a, node_b2]
        # Rank 0 (which logs) may now be on either node.
        found: list[tuple[str, int, float]] = []

        def resumed() -> bool:
            for agent in agents:
                if any(r[0] >= killed_at for r in resumes_logged(agent)) and first_step_after(agent, killed_at):
                    found.append(_resumed_after(agent, killed_at, agents))
                    return True
            return False

        wait_until("the resumed group's first step", resumed, agents, RESUME_TIMEOUT_S)
        name, step, seconds = found[0]
        assert (name, step) == (f"step_{newest:06d}", newest), logs(agents)
        failed = False
    finally:
        _finish(agents, failed)
    _assert_same_as_reference(paths, reference)
    assert newest - step == 0, (seconds, newest, step)
    with capsys.disabled():
        print(f"\nkilled node B (agent and worker), started B': first resumed step {seconds:.2f} s after the kill, "
              f"{newest - step} steps lost beyond the newest checkpoint (step {newest})")
