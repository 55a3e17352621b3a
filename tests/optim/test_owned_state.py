"""The state of optimizers stepped by owners ([Note: owned optimizer state]
in composable_shard/state_dict/owned.py): full and sharded optimizer state
dicts hold what one process holds, keyed by name; ``save_checkpoint`` /
``load_checkpoint`` and plain DCP take several optimizers; a checkpoint saved
at 2 ranks resumes at 4 and at 1 and continues in parity with a run that
never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from composable_shard import (
    ShardingStrategy,
    StateDictOptions,
    full_shape,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
    unshard_params,
)

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.optimizers import NewtonSchulzSGD
from tests.support.parity import shard_manually

FULL = StateDictOptions(full_state_dict=True)
SAVE_AT, END = 2, 4
ATOL, RTOL = 2e-6, 1e-5


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """Two optimizers on one model: an owner-stepped one on the blocks'
    matrices (chosen by full_shape, so after sharding too) and another on
    the rest — owner-stepped as well (Adafactor) or elementwise (AdamW)."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and len(full_shape(p)) == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    second = torch.optim.Adafactor(rest, lr=1e-2) if kind == "adafactor" else torch.optim.AdamW(rest, lr=1e-2)
    return [NewtonSchulzSGD(matrices), second]


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: range, *, rank: int, world_size: int) -> None:
    for step in steps:
        inputs, targets = batch(step)
        local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        lm_loss(model(inputs[local]), targets[local]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _reference(kind: str, steps: int) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizers = _optimizers(model, kind)
    _train(model, optimizers, range(steps), rank=0, world_size=1)
    return model, optimizers


def _sharded(kind: str, seed: int = 0) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = TinyGPT()
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    return model, _optimizers(model, kind)


def _reference_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(values) for p, values in optimizer.state.items()}


def _assert_state_equal(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: parameters {sorted(got)} != {sorted(expected)}"
    for fqn in expected:
        assert sorted(got[fqn]) == sorted(expected[fqn]), f"{what}: {fqn} keys {sorted(got[fqn])} != {sorted(expected[fqn])}"
        for key, value in expected[fqn].items():
            torch.testing.assert_close(
                torch.as_tensor(got[fqn][key]).float(), torch.as_tensor(value).float(), atol=ATOL, rtol=RTOL,
                msg=lambda m: f"{what}: {fqn}.{key}: {m}",
            )


def _assert_params_equal(model: nn.Module, reference: nn.Module, what: str) -> None:
    expected = dict(reference.named_parameters())
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, expected[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {name}: {m}")


def _state_dicts_equal_the_reference(rank: int, world_size: int) -> None:
    for kind in ("adafactor", "adamw"):
        reference, reference_optimizers = _reference(kind, SAVE_AT)
        model, optimizers = _sharded(kind)
        _train(model, optimizers, range(SAVE_AT), rank=rank, world_size=world_size)
        for index, (optimizer, reference_optimizer) in enumerate(zip(optimizers, reference_optimizers)):
            expected = _reference_state(reference, reference_optimizer)
            full = get_optimizer_state_dict(model, optimizer, options=FULL)
            _assert_state_equal(full["state"], expected, f"{kind} optimizer {index}, full state dict")
            # Whole tensors live on the owner only; every parameter's state is held by exactly one rank.
            sharded = get_optimizer_state_dict(model, optimizer)
            holders = [None] * world_size
            dist.all_gather_object(holders, sorted(n for n, v in sharded["state"].items() if v))
            if kind == "adafactor" or index == 0:
                counted = sorted(n for names in holders for n in names)
                assert counted == sorted(expected), f"{kind} optimizer {index}: held {counted}"
            # Loading the full state dict into fresh optimizers gives back the same state.
            fresh_model, fresh_optimizers = _sharded(kind, seed=1)
            set_model_state_dict(fresh_model, get_model_state_dict(model, options=FULL), options=FULL)
            set_optimizer_state_dict(fresh_model, fresh_optimizers[index], full, options=FULL)
            again = get_optimizer_state_dict(fresh_model, fresh_optimizers[index], options=FULL)
            _assert_state_equal(again["state"], expected, f"{kind} optimizer {index}, full state dict loaded")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_optimizer_state_dicts_hold_what_one_process_holds(world_size: int) -> None:
    run_distributed(_state_dicts_equal_the_reference, world_size)


def _save(rank: int, world_size: int, root: str) -> None:
    for kind in ("adafactor", "adamw"):
        model, optimizers = _sharded(kind)
        _train(model, optimizers, range(SAVE_AT), rank=rank, world_size=world_size)
        save_checkpoint(Path(root) / f"{kind}-safe", model, optimizers)
        state = {"model": get_model_state_dict(model)}
        state.update({f"optim{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)})
        dcp.save(state, checkpoint_id=Path(root) / f"{kind}-dcp")


def _resume_and_continue(rank: int, world_size: int, root: str) -> None:
    for kind in ("adafactor", "adamw"):
        for via in ("safe", "dcp"):
            model, optimizers = _sharded(kind, seed=1)  # other values: everything comes from the checkpoint
            if via == "safe":
                load_checkpoint(Path(root) / f"{kind}-safe", model, optimizers)
            else:
                state = {"model": get_model_state_dict(model)}
                state.update({f"optim{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)})
                dcp.load(state, checkpoint_id=Path(root) / f"{kind}-dcp")
                set_model_state_dict(model, state["model"])
                for i, optimizer in enumerate(optimizers):
                    set_optimizer_state_dict(model, optimizer, state[f"optim{i}"])
            reference, reference_optimizers = _reference(kind, SAVE_AT)
            for step in range(SAVE_AT, END):
                _train(model, optimizers, range(step, step + 1), rank=rank, world_size=world_size)
                _train(reference, reference_optimizers, range(step, step + 1), rank=0, world_size=1)
                _assert_params_equal(model, reference, f"{kind} via {via}, resumed at {world_size} ranks, step {step}")
            for index, (optimizer, reference_optimizer) in enumerate(zip(optimizers, reference_optimizers)):
                full = get_optimizer_state_dict(model, optimizer, options=FULL)
                _assert_state_equal(full["state"], _reference_state(reference, reference_optimizer), f"{kind} via {via} optimizer {index}")


def test_save_at_two_ranks_resume_at_four_and_one_in_parity(tmp_path: Path) -> None:
    run_distributed(_save, 2, str(tmp_path))
    run_distributed(_resume_and_continue, 4, str(tmp_path))
    run_distributed(_resume_and_continue, 1, str(tmp_path))
