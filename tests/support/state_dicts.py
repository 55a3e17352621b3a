"""Owns: what the state-dict and checkpoint tests share — the options for full
state dicts, the ways a test shards a model (by name), data-parallel training
steps, the optimizers, full-state snapshots and comparisons, damaging a
checkpoint file, and sharding with PyTorch's FSDP2 for interchange tests.

Knows nothing of: which state-dict or checkpoint behaviour is under test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    SmallUnitGroups,
    StateDictOptions,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    unshard_params,
)
from composable_shard.runtime.state import get_state

from .models import Block, batch, lm_loss
from .parity import hybrid_groups


FULL = StateDictOptions(full_state_dict=True)
FULL_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(model: nn.Module, how: str) -> nn.Module:
    """Shard ``model`` one of several ways (names used by every test)."""
    if how == "manual":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif how == "policy":
        fully_shard(model, policy=ModuleWrapPolicy({Block}))
    elif how == "root_only":
        fully_shard(model)
    elif how == "no_shard":
        for block in model.blocks:
            fully_shard(block, strategy=ShardingStrategy.NO_SHARD)
        fully_shard(model, strategy=ShardingStrategy.NO_SHARD)
    elif how == "hybrid":
        groups = hybrid_groups(dist.get_world_size())
        for block in model.blocks:
            fully_shard(block, strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)
        fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)
    elif how == "mixed":  # bf16 compute and buffers: state dicts keep the original dtypes
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mixed_precision=policy)
        fully_shard(model, mixed_precision=policy)
    elif how == "small_groups":  # the blocks as one group ([Note: groups of small units])
        fully_shard(model, policy=SmallUnitGroups({Block}))
        assert get_state(model.blocks[0]) is get_state(model.blocks[-1])
    elif how == "ignored":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model, ignored_states=[model.norm])
    else:
        raise ValueError(how)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (collective), by canonical name."""
    with unshard_params(model, writeback=False):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_tensors(actual: dict[str, Any], expected: dict[str, Any], what: str, *, atol: float = 0.0) -> None:
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got = actual[key]
        if isinstance(value, dict) and isinstance(got, dict):
            assert_same_tensors(got, value, f"{what} {key}", atol=atol)
        elif isinstance(value, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.shape == value.shape, (what, key, got, value.shape)
            torch.testing.assert_close(got, value, atol=atol, rtol=0 if atol == 0 else 1e-5, msg=lambda m: f"{what} {key}: {m}")
        else:
            assert got == value, (what, key, got, value)


def perturbed(state_dict: dict[str, Any], delta: float) -> dict[str, Any]:
    return {
        k: v + delta if isinstance(v, torch.Tensor) and v.is_floating_point() else copy.deepcopy(v)
        for k, v in state_dict.items()
    }


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, global_batch: int = 8) -> list[float]:
    """Data-parallel steps on this rank's slice of each global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        inputs, targets = batch(step, global_batch)
        local = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
        loss = lm_loss(model(inputs[local]), targets[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def decays(name: str) -> bool:
    """Whether the parameter called ``name`` gets weight decay in ``make_optimizer``'s AdamW."""
    return name.endswith("weight") and "norm" not in name


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with a decay and a no-decay group, or SGD with momentum."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # By name: sharded parameters are 1-D, so their dim() says nothing.
    decay = [p for name, p in model.named_parameters() if decays(name)]
    no_decay = [p for name, p in model.named_parameters() if not decays(name)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=FULL),
        # Each parameter's state names sorted: a loaded optimizer's order follows the checkpoint.
        "optim": {
            fqn: dict(sorted(values.items()))
            for fqn, values in get_optimizer_state_dict(model, optimizer, options=FULL)["state"].items()
        },
    }


def damage(path: Path, how: str) -> None:
    """Rank 0 damages a file; every rank waits for it."""
    if dist.get_rank() == 0:
        if how == "truncate":
            with open(path, "r+b") as stream:
                stream.truncate(path.stat().st_size // 2)
        elif how == "flip":
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.unlink()
    dist.barrier()


def shard_with_fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    except ImportError:  # older torch (2.4): FSDP2 under its earlier name
        from torch.distributed._composable.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(model, mesh=mesh)
    return model
