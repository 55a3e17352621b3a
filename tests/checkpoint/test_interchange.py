"""Checkpoints move between composable_shard and PyTorch's FSDP2 both ways
and across world sizes: what composable_shard saves with ``dcp.save`` loads
into the same model sharded by ``torch.distributed.fsdp.fully_shard``
(through ``torch.distributed.checkpoint.state_dict``) at another world size
with identical parameters and optimizer state, and what FSDP2 saves loads
back into composable_shard identically (2 -> 4 -> 2 and 4 -> 2 -> 4).

FSDP2 is a peer used only here (the package never imports it). Each world
size runs in its own pool; the launches share ``tmp_path``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_state_dict
import torch.nn as nn

from composable_shard import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, shard_with_fsdp2, train_steps

TORCH_FULL = torch_state_dict.StateDictOptions(full_state_dict=True)


def _build(stack: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT()
    model = shard_with_fsdp2(model) if stack == "fsdp2" else shard(model, "manual")
    return model, make_optimizer("adamw", model)


def _full_values(stack: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and optimizer state, by name, from the stack's own API."""
    if stack == "fsdp2":
        model_state = torch_state_dict.get_model_state_dict(model, options=TORCH_FULL)
        optim_state = torch_state_dict.get_optimizer_state_dict(model, optimizer, options=TORCH_FULL)
    else:
        model_state = get_model_state_dict(model, options=FULL)
        optim_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    return {
        "model": {key: value.detach().clone() for key, value in sorted(model_state.items())},
        "optim": {fqn: dict(sorted(values.items())) for fqn, values in sorted(optim_state["state"].items())},
        "groups": [
            {k: v for k, v in group.items() if k != "params"} | {"params": sorted(group["params"])}
            for group in optim_state["param_groups"]
        ],
    }


def _sharded_state(stack: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if stack == "fsdp2":
        return {
            "model": torch_state_dict.get_model_state_dict(model),
            "optim": torch_state_dict.get_optimizer_state_dict(model, optimizer),
        }
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def _save_trained(rank: int, world_size: int, stack: str, path: str) -> dict[str, Any]:
    """Train two steps, save with plain DCP, return the full values."""
    model, optimizer = _build(stack, seed=0)
    train_steps(model, optimizer, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        dcp.save(_sharded_state(stack, model, optimizer), checkpoint_id=path)
    return _full_values(stack, model, optimizer)


def _load_and_compare(rank: int, world_size: int, stack: str, path: str, expected: dict[str, Any], save_to: str) -> dict[str, Any]:
    """Load ``path`` into a fresh model of ``stack`` (other initial values),
    check every value is identical, train one more step and save again."""
    model, optimizer = _build(stack, seed=1)
    state = _sharded_state(stack, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        dcp.load(state, checkpoint_id=path)
    if stack == "fsdp2":
        torch_state_dict.set_model_state_dict(model, state["model"])
        torch_state_dict.set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = _full_values(stack, model, optimizer)
    assert_same_tensors(loaded["model"], expected["model"], f"{stack} at {world_size} ranks: parameters")
    assert_same_tensors(loaded["optim"], expected["optim"], f"{stack} at {world_size} ranks: optimizer state")
    assert loaded["groups"] == expected["groups"], (loaded["groups"], expected["groups"])
    train_steps(model, optimizer, range(2, 3))
    dcp.save(_sharded_state(stack, model, optimizer), checkpoint_id=save_to)
    return _full_values(stack, model, optimizer)


@pytest.mark.parametrize("first, second", [(2, 4), (4, 2)], ids=["2-4-2", "4-2-4"])
def test_checkpoints_interchange_with_fsdp2_across_world_sizes(first: int, second: int, tmp_path: Path) -> None:
    ours = str(tmp_path / "ours")
    theirs = str(tmp_path / "fsdp2")
    again = str(tmp_path / "ours-again")
    expected = run_distributed(_save_trained, first, "composable_shard", ours)[0]
    after_fsdp2 = run_distributed(_load_and_compare, second, "fsdp2", ours, expected, theirs)[0]
    run_distributed(_load_and_compare, first, "composable_shard", theirs, after_fsdp2, again)
