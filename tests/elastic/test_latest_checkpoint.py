"""``latest_checkpoint``: the newest complete checkpoint under a directory,
as a restarted job needs it. None on a first start (directory missing or
empty); the largest number in the name wins (``step_10`` over ``step_2``);
staging directories (``.partial``), directories without a checkpoint and
names without a number are passed over; a damaged newest one is skipped
with a warning (``verify=True``) and the next one resumes exactly; every
rank gets the same answer; a file in place of the directory is refused on
every rank, and the model still trains."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from composable_shard.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import assert_same_tensors, damage, make_optimizer, shard, snapshot, train_steps


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _latest(rank: int, world_size: int, root: str) -> dict[str, object]:
    root_dir = Path(root)
    save_dir = root_dir / "run"
    found: dict[str, object] = {
        "missing": latest_checkpoint(root_dir / "missing"),
    }
    if rank == 0:
        (root_dir / "empty").mkdir()
        (root_dir / "a_file").write_text("not a directory")
    dist.barrier()
    found["empty"] = latest_checkpoint(root_dir / "empty")

    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    expected = {}
    for step in range(4):
        train_steps(model, optimizer, range(step, step + 1))
        expected[step + 1] = snapshot(model, optimizer)
        if step + 1 in (2, 3):
            save_checkpoint(save_dir / f"step_{10 if step + 1 == 3 else 2}", model, optimizer)  # "step_10" sorts first by text
    if rank == 0:  # what is not a candidate, all "newer" by number
        (save_dir / "step_12.partial").mkdir()
        (save_dir / "step_12.partial" / ".metadata").write_bytes(b"half")
        (save_dir / "step_11").mkdir()  # no checkpoint in it
        (save_dir / "final").mkdir()
        (save_dir / "final" / ".metadata").write_bytes(b"no number in the name")
        (save_dir / "step_13").write_text("a file")
    dist.barrier()
    found["newest"] = latest_checkpoint(save_dir)

    warnings = _Warnings()
    logging.getLogger("composable_shard.checkpoint.latest").addHandler(warnings)
    try:
        damage(next((save_dir / "step_10").glob("*.distcp")), "flip")
        found["after_damage"] = latest_checkpoint(save_dir)
        found["unverified"] = latest_checkpoint(save_dir, verify=False)
    finally:
        logging.getLogger("composable_shard.checkpoint.latest").removeHandler(warnings)
    found["warnings"] = warnings.messages

    try:
        latest_checkpoint(root_dir / "a_file")
    except NotADirectoryError as exc:
        found["refusal"] = str(exc)

    # Resume from what it found, then the next steps follow the uninterrupted run.
    resumed = shard(BufferedGPT(), "manual")
    resumed_optimizer = make_optimizer("adamw", resumed)
    load_checkpoint(found["after_damage"], resumed, resumed_optimizer)  # type: ignore[arg-type]
    assert_same_tensors(snapshot(resumed, resumed_optimizer)["model"], expected[2]["model"], "loaded")
    train_steps(resumed, resumed_optimizer, range(2, 4))
    assert_same_tensors(snapshot(resumed, resumed_optimizer)["model"], expected[4]["model"], "resumed, 2 steps")
    assert_same_tensors(snapshot(resumed, resumed_optimizer)["optim"], expected[4]["optim"], "resumed optimizer")
    return found


def test_latest_checkpoint_finds_the_newest_complete_one_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_latest, 2, str(tmp_path))
    assert results[0] == results[1]  # the same answer on every rank
    found = results[0]
    assert found["missing"] is None and found["empty"] is None
    assert found["newest"] == tmp_path / "run" / "step_10"
    assert found["after_damage"] == tmp_path / "run" / "step_2"
    assert found["unverified"] == tmp_path / "run" / "step_10"
    assert len(found["warnings"]) == 1, found["warnings"]
    assert "skipping the damaged checkpoint" in found["warnings"][0] and "step_10" in found["warnings"][0]
    assert "does not match its checksum" in found["warnings"][0]
    assert f"latest_checkpoint('{tmp_path / 'a_file'}'): " in found["refusal"]
    assert "is not a directory. Pass the directory the checkpoints are saved under." in found["refusal"]
