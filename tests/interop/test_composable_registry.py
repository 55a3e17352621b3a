"""fully_shard beside torch's composable ``replicate`` (DDP applied in place),
the configurations of FSDP2's test_replicate_and_fully_shard on TinyGPT:
units inside a replicated model, replicated modules inside a unit, both
nested. Each trains in parity with one process on the global batch (loss,
full gradients and parameters every step), and each side leaves the
other's parameters alone; a checkpoint of such a model round-trips.
Refusals: fully_shard on a module replicate manages, replicate on a unit.
2 ranks.

Pinned: [Note: composing with torch's replicate] in
interop/composable_registry.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed._composable import replicate

from composable_shard import StateDictOptions, fully_shard, get_model_state_dict, load_checkpoint, plan, save_checkpoint
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, run_parity


def _sharded_param_ids(model: nn.Module) -> set[int]:
    return {id(param) for _, state in unit_states_under(model) for handle in state.handles for param in handle.orig_params}


def _units_inside_replicated_model(model: nn.Module) -> None:
    # "1fm,1r": replicate skips the units' subtrees.
    for block in model.blocks:
        fully_shard(block)
    replicate(model)


def _replicated_block_inside_unit(model: nn.Module) -> None:
    # "1r,1fm": the root unit leaves the replicated block to DDP.
    replicate(model.blocks[1])
    fully_shard(model)


def _replicated_and_sharded_blocks(model: nn.Module) -> None:
    # "1r1fm,1fm"
    replicate(model.blocks[0])
    fully_shard(model.blocks[2])
    fully_shard(model)


def _units_inside_replicated_blocks(model: nn.Module) -> None:
    # "1fm1fm,1r1r,1fm": units inside replicated blocks inside the root unit.
    for block in model.blocks[:2]:
        fully_shard(block.fc_in)
    for block in model.blocks[:2]:
        replicate(block)
    fully_shard(model)


def _under(*prefixes: str):
    return lambda name: name.startswith(prefixes)


# How to shard, and which parameters (by name) replicate keeps.
CONFIGS = {
    "units_inside_replicated_model": (_units_inside_replicated_model, lambda name: not name.startswith("blocks.")),
    "replicated_block_inside_unit": (_replicated_block_inside_unit, _under("blocks.1.")),
    "replicated_and_sharded_blocks": (_replicated_and_sharded_blocks, _under("blocks.0.")),
    "units_inside_replicated_blocks": (
        _units_inside_replicated_blocks,
        _under("blocks.0.fc_out.", "blocks.0.norm.", "blocks.1.fc_out.", "blocks.1.norm."),
    ),
}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_in_parity(rank: int, world_size: int, config: str) -> None:
    shard, is_replicated = CONFIGS[config]
    models: list[nn.Module] = []

    def shard_and_keep(model: nn.Module) -> None:
        shard(model)
        models.append(model)

    for make_optimizer in (_sgd, lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2)):
        models.clear()
        parity = Parity(build=TinyGPT, shard=shard_and_keep, steps=3, make_optimizer=make_optimizer)
        run_parity(parity)
        assert len(parity.compared) == 3 * len(list(models[0].parameters())), parity.compared
        # Each replicated parameter is DDP's, plain and whole; every other one is a unit's.
        sharded = _sharded_param_ids(models[0])
        for name, param in models[0].named_parameters():
            assert (id(param) in sharded) != is_replicated(name), (config, name)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fully_shard_and_replicate_train_in_parity(config: str) -> None:
    run_distributed(_train_in_parity, 2, config)


def _refusals(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    replicate(model.blocks[0])
    with pytest.raises(ValueError, match=r"fully_shard\(DDPBlock\): this module is managed by torch's replicate\(\)"):
        fully_shard(model.blocks[0])
    with pytest.raises(ValueError, match=r"fully_shard\(DDPBlock\): this module is managed by torch's replicate\(\)"):
        plan(model.blocks[0], world_size=world_size)
    # The plan of the parent leaves the replicated block out, as fully_shard does.
    planned = plan(model, world_size=world_size)
    replicated = {id(param) for param in model.blocks[0].parameters()}
    outside = sum(param.numel() for param in model.parameters() if id(param) not in replicated)
    assert sum(unit.numel for unit in planned.units) == outside

    fully_shard(model.blocks[1])
    with pytest.raises(RuntimeError, match="already managed by `fully_shard`"):
        replicate(model.blocks[1])
    # Nothing was changed by the refusals: the rest shards and trains.
    fully_shard(model)
    assert not any(id(param) in _sharded_param_ids(model) for param in model.blocks[0].parameters())
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()


def test_fully_shard_refuses_a_replicated_module_and_replicate_refuses_a_unit() -> None:
    run_distributed(_refusals, 2)


def _checkpoint_round_trip(rank: int, world_size: int, directory: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyGPT()
        _replicated_and_sharded_blocks(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        inputs, targets = batch(step)
        local = slice(rank * 4, rank * 4 + 4)
        lm_loss(model(inputs[local]), targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()

    full = StateDictOptions(full_state_dict=True)
    model, optimizer = build()
    for step in range(2):
        train_step(model, optimizer, step)
    save_checkpoint(directory, model, optimizer)
    loaded, loaded_optimizer = build()
    load_checkpoint(directory, loaded, loaded_optimizer)
    saved_values = get_model_state_dict(model, options=full)
    loaded_values = get_model_state_dict(loaded, options=full)
    assert saved_values.keys() == loaded_values.keys() == model.state_dict().keys()
    for name, value in saved_values.items():
        torch.testing.assert_close(loaded_values[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    # The optimizer state came back too: the next step is the same, bit for bit.
    train_step(model, optimizer, 2)
    train_step(loaded, loaded_optimizer, 2)
    loaded_values = get_model_state_dict(loaded, options=full)
    for name, value in get_model_state_dict(model, options=full).items():
        torch.testing.assert_close(loaded_values[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def test_a_checkpoint_of_replicated_and_sharded_modules_round_trips(tmp_path) -> None:
    run_distributed(_checkpoint_round_trip, 2, str(tmp_path / "checkpoint"))
