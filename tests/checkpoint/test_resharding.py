"""Checkpoints across world sizes and strategies, and their safety: a
checkpoint saved at one world size resumes at another (2 -> 4, 1 and
4 -> 2, 1; FULL_SHARD -> NO_SHARD / HYBRID; a unit per block -> the blocks
grouped and back) and training then follows the
run that never stopped; a damaged, truncated, foreign or misshaped
checkpoint is refused before anything changes; an interrupted save leaves
the previous checkpoint loadable; a verified checkpoint is read in place.

Each test saves in one ``run_distributed`` launch and loads in others, with
a shared ``tmp_path``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import composable_shard.checkpoint.save_load as checkpoint_module
from composable_shard import (
    CheckpointError,
    StateDictError,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from composable_shard.checkpoint import MANIFEST_NAME
from composable_shard.state_dict import RangeShardedTensor

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import (
    FULL,
    assert_same_tensors,
    damage,
    full_params,
    make_optimizer,
    shard,
    snapshot,
    train_steps,
)

SAVED_AT_STEP = 2
MORE_STEPS = 3
# Data-parallel training at two world sizes differs by float round-off only.
ATOL = 2e-6


def _save_and_continue(rank: int, world_size: int, root: str, how: str) -> list[dict[str, torch.Tensor]]:
    """Train, save (with save_checkpoint and with plain DCP), keep training;
    return the full parameters after each further step (the run that never
    stopped)."""
    torch.manual_seed(0)
    model = shard(BufferedGPT(), how)
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(SAVED_AT_STEP))
    model.counter.count = SAVED_AT_STEP
    save_checkpoint(f"{root}/ckpt", model, optimizer, extra_state={"step": SAVED_AT_STEP, "note": "resume"})
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=f"{root}/raw")
    trajectory = []
    for step in range(SAVED_AT_STEP, SAVED_AT_STEP + MORE_STEPS):
        train_steps(model, optimizer, range(step, step + 1))
        trajectory.append(full_params(model))
    return trajectory


def _resume_and_compare(rank: int, world_size: int, root: str, hows: list[str], expected: list[dict[str, torch.Tensor]]) -> None:
    for how in hows:
        for source in ("ckpt", "raw"):
            torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
            model = shard(BufferedGPT(), how)
            optimizer = make_optimizer("adamw", model)
            if source == "ckpt":
                extra = load_checkpoint(f"{root}/ckpt", model, optimizer)
                assert extra == {"step": SAVED_AT_STEP, "note": "resume"}, extra
                assert model.counter.count == SAVED_AT_STEP
            else:  # plain DCP with our state dicts, as they are
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
                dcp.load(state, checkpoint_id=f"{root}/raw")
                set_model_state_dict(model, state["model"])
                set_optimizer_state_dict(model, optimizer, state["optim"])
            for index, step in enumerate(range(SAVED_AT_STEP, SAVED_AT_STEP + MORE_STEPS)):
                train_steps(model, optimizer, range(step, step + 1))
                assert_same_tensors(full_params(model), expected[index], f"{how} from {source}, step {step}", atol=ATOL)


def test_checkpoint_saved_at_2_resumes_at_4_and_1_like_uninterrupted_training(tmp_path: Path) -> None:
    expected = run_distributed(_save_and_continue, 2, str(tmp_path), "manual")[0]
    # A unit per block saved, the blocks as one group resumed.
    run_distributed(_resume_and_compare, 4, str(tmp_path), ["manual", "no_shard", "hybrid", "small_groups"], expected)
    run_distributed(_resume_and_compare, 1, str(tmp_path), ["policy"], expected)


def test_checkpoint_saved_at_4_resumes_at_2_and_1_like_uninterrupted_training(tmp_path: Path) -> None:
    expected = run_distributed(_save_and_continue, 4, str(tmp_path), "hybrid")[0]
    run_distributed(_resume_and_compare, 2, str(tmp_path), ["policy", "no_shard", "small_groups"], expected)
    run_distributed(_resume_and_compare, 1, str(tmp_path), ["manual"], expected)


def test_checkpoint_saved_with_the_blocks_grouped_resumes_with_a_unit_per_block(tmp_path: Path) -> None:
    """The parameters' local parts follow the group's flat layout when
    saved, each block's when loaded ([Note: groups of small units])."""
    expected = run_distributed(_save_and_continue, 2, str(tmp_path), "small_groups")[0]
    run_distributed(_resume_and_compare, 2, str(tmp_path), ["manual"], expected)


# ------------------------------------------------------------------ safety
def _damaged_checkpoints_are_refused(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    directory = Path(root) / "ckpt"
    save_checkpoint(directory, model, optimizer)
    train_steps(model, optimizer, range(1, 2))  # the model moves on from the checkpoint
    before = snapshot(model, optimizer)
    data_file = sorted(directory.glob("__*.distcp"))[-1]

    def refused(error: type[BaseException], match: str) -> None:
        with pytest.raises(error, match=match):
            load_checkpoint(directory, model, optimizer)
        now = snapshot(model, optimizer)
        assert_same_tensors(now["model"], before["model"], f"model after refused load ({match})")
        assert_same_tensors(now["optim"], before["optim"], f"optimizer after refused load ({match})")

    damage(data_file, "truncate")
    refused(CheckpointError, rf"file '{data_file.name}' has \d+ bytes, the manifest records \d+ \(truncated")
    save_checkpoint(directory, model, optimizer)  # overwrite: replaced in one switch
    assert not directory.with_name("ckpt.partial").exists() and not directory.with_name("ckpt.previous").exists()
    damage(data_file, "flip")
    refused(CheckpointError, rf"file '{data_file.name}' does not match its checksum \(corrupted\)")
    save_checkpoint(directory, model, optimizer)
    damage(directory / ".metadata", "truncate")
    refused(CheckpointError, r"file '.metadata' has \d+ bytes")
    damage(directory / MANIFEST_NAME, "delete")  # unverifiable: DCP's own read fails, we say so
    refused(CheckpointError, "cannot read the checkpoint's metadata")
    save_checkpoint(directory, model, optimizer)
    damage(directory / MANIFEST_NAME, "delete")
    damage(data_file, "truncate")
    refused(CheckpointError, r"claims bytes \d+\.\.\d+ of '__\d_0.distcp', which has \d+.*Nothing was loaded")
    with pytest.raises(CheckpointError, match="no checkpoint directory at"):
        load_checkpoint(Path(root) / "nowhere", model)

    # A save that fails half-way leaves the previous checkpoint whole.
    save_checkpoint(directory, model, optimizer)
    saved = snapshot(model, optimizer)
    train_steps(model, optimizer, range(2, 3))
    real_save = checkpoint_module.dcp.save

    def failing_save(state: dict[str, Any], **kwargs: Any) -> Any:
        real_save({"model": state["model"]}, **kwargs)  # some files written, then the crash
        raise OSError("disk full")

    checkpoint_module.dcp.save = failing_save  # type: ignore[assignment]
    try:
        with pytest.raises(CheckpointError, match=r"writing the checkpoint failed \(OSError: disk full\)"):
            save_checkpoint(directory, model, optimizer)
    finally:
        checkpoint_module.dcp.save = real_save  # type: ignore[assignment]
    assert directory.with_name("ckpt.partial").exists()
    load_checkpoint(directory, model, optimizer)
    now = snapshot(model, optimizer)
    assert_same_tensors(now["model"], saved["model"], "model from the checkpoint before the failed save")
    assert_same_tensors(now["optim"], saved["optim"], "optimizer from the checkpoint before the failed save")
    save_checkpoint(directory, model, optimizer)  # the next save cleans up
    assert not directory.with_name("ckpt.partial").exists()
    train_steps(model, optimizer, range(3, 4))


@pytest.mark.parametrize("world_size", [2])
def test_damaged_checkpoint_is_refused_and_failed_save_keeps_the_previous(world_size: int, tmp_path: Path) -> None:
    run_distributed(_damaged_checkpoints_are_refused, world_size, str(tmp_path))


def _save_small(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    save_checkpoint(f"{root}/ckpt", model, optimizer)


def _foreign_checkpoints_are_refused(rank: int, world_size: int, root: str) -> None:
    directory = f"{root}/ckpt"
    for build, match in (
        (lambda: BufferedGPT(dim=24), r"'tok_emb.weight': shape \(32, 16\) does not match the model's \(32, 24\)"),
        (lambda: BufferedGPT(n_blocks=2), r"Unexpected key\(s\) in state_dict: 'blocks\.2\."),
        (lambda: BufferedGPT(n_blocks=4), r"Missing key\(s\) in state_dict: 'blocks\.3\.seen', 'blocks\.3\.norm\.weight'"),
    ):
        torch.manual_seed(0)
        model = shard(build(), "manual")
        optimizer = make_optimizer("adamw", model)
        train_steps(model, optimizer, range(1))
        before = snapshot(model, optimizer)
        with pytest.raises(StateDictError, match=match):
            load_checkpoint(directory, model, optimizer)
        now = snapshot(model, optimizer)
        assert_same_tensors(now["model"], before["model"], f"model after refusing ({match})")
        assert_same_tensors(now["optim"], before["optim"], f"optimizer after refusing ({match})")
        train_steps(model, optimizer, range(1, 2))
    # strict=False loads what both have: the first two blocks.
    torch.manual_seed(3)
    small = shard(BufferedGPT(n_blocks=2), "manual")
    small_optimizer = make_optimizer("adamw", small)
    load_checkpoint(directory, small, small_optimizer, strict=False)
    torch.manual_seed(0)
    reference = shard(BufferedGPT(), "manual")
    reference_optimizer = make_optimizer("adamw", reference)
    load_checkpoint(directory, reference, reference_optimizer)
    loaded, expected = get_model_state_dict(small, options=FULL), get_model_state_dict(reference, options=FULL)
    assert_same_tensors(loaded, {k: v for k, v in expected.items() if k in loaded}, "strict=False load")


def test_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    run_distributed(_save_small, 2, str(tmp_path))
    run_distributed(_foreign_checkpoints_are_refused, 4, str(tmp_path))


# ----------------------------------------------------------- in place
def _loads_in_place(rank: int, world_size: int, root: str) -> None:
    """A verified checkpoint is read straight into the model's shards and
    the optimizer's state tensors: DCP's destination holds views of them,
    and no state tensor is replaced."""
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(2))
    directory = f"{root}/ckpt"
    read_back: list[str] = []
    real_record = checkpoint_module.file_record

    def recording_record(path: Path) -> dict[str, int]:  # a spy: calls through
        read_back.append(path.name)
        return real_record(path)

    checkpoint_module.file_record = recording_record  # type: ignore[assignment]
    try:
        save_checkpoint(directory, model, optimizer)
    finally:
        checkpoint_module.file_record = real_record  # type: ignore[assignment]
    # Data files are checksummed as they are written; only the small metadata file is read back.
    assert read_back == ([".metadata"] if rank == 0 else []), read_back
    manifest = json.loads((Path(directory) / MANIFEST_NAME).read_text())
    for name, record in manifest["files"].items():
        assert record == real_record(Path(directory) / name), name
    saved = snapshot(model, optimizer)
    train_steps(model, optimizer, range(2, 3))  # the live state moves on
    shard_ptrs = {key: value.local.data_ptr() for key, value in get_model_state_dict(model).items() if isinstance(value, RangeShardedTensor) and value.local.numel()}
    state_ptrs = {(id(p), key): value.data_ptr() for p, values in optimizer.state.items() for key, value in values.items() if key != "step" and value.numel()}
    destinations: list[dict[str, Any]] = []
    real_load = checkpoint_module.dcp.load

    def recording_load(state: dict[str, Any], **kwargs: Any) -> Any:  # a spy: calls through
        destinations.append(state)
        return real_load(state, **kwargs)

    checkpoint_module.dcp.load = recording_load  # type: ignore[assignment]
    try:
        load_checkpoint(directory, model, optimizer)
    finally:
        checkpoint_module.dcp.load = real_load  # type: ignore[assignment]
    # One read (the manifest names the optimizer's parameters, so they are checked before it).
    assert [sorted(d) for d in destinations] == [["model", "optim"]], [sorted(d) for d in destinations]
    read_into = {key: value.local.data_ptr() for key, value in destinations[-1]["model"].items() if isinstance(value, RangeShardedTensor) and value.local.numel()}
    assert read_into == shard_ptrs
    now_ptrs = {(id(p), key): value.data_ptr() for p, values in optimizer.state.items() for key, value in values.items() if key != "step" and value.numel()}
    assert now_ptrs == state_ptrs
    now = snapshot(model, optimizer)
    assert_same_tensors(now["model"], saved["model"], "model loaded in place")
    assert_same_tensors(now["optim"], saved["optim"], "optimizer loaded in place")
    train_steps(model, optimizer, range(2, 3))


@pytest.mark.parametrize("world_size", [2])
def test_verified_checkpoint_loads_in_place_into_shards_and_optimizer_state(world_size: int, tmp_path: Path) -> None:
    run_distributed(_loads_in_place, world_size, str(tmp_path))
