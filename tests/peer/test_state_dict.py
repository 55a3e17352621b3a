"""Ports of FSDP2's test_fully_shard_state_dict.py and the applicable parts
of test_fully_shard_init.py (see tests/peer/SCENARIOS.md): state dicts of
small, unevenly sharded nested models (ranks holding nothing of some
parameters) give the unsharded model's values, load new values in place into
the shards, and do not change across a forward whose units stay gathered;
lazy init makes the outermost unit the root and names every unit; what
FSDP2 refuses at init we refuse or support with a clear outcome."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from composable_shard import (
    ShardingStrategy,
    fully_shard,
    get_model_state_dict,
    set_model_state_dict,
    unshard_params,
)
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import MLP


def _nested(dim: int) -> nn.Module:
    return nn.Sequential(MLP(dim, 1), nn.Sequential(MLP(dim, 1), nn.Linear(dim, dim)), MLP(dim, 1))


def _shard(model: nn.Module, strategy: ShardingStrategy) -> None:
    for module in model:
        fully_shard(module, strategy=strategy)
    fully_shard(model, strategy=strategy)


def _state_dicts_of_small_uneven_models(rank: int, world_size: int) -> None:
    for dim in (2, 3, 4, 5):
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            when = f"dim {dim} {strategy.name}"
            torch.manual_seed(0)
            model = _nested(dim)
            reference = copy.deepcopy(model)
            _shard(model, strategy)
            full = model.state_dict()
            assert list(full) == list(reference.state_dict()), when
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(full[name], value, msg=lambda m: f"{when} {name}: {m}")
            # Load new values: the shards change in place (same storage).
            pointers = {name: p.data_ptr() for name, p in model.named_parameters() if p.numel()}
            new_values = {name: torch.full_like(value, 42.0 + index) for index, (name, value) in enumerate(full.items())}
            model.load_state_dict(new_values)
            assert {name: p.data_ptr() for name, p in model.named_parameters() if p.numel()} == pointers, when
            with unshard_params(model, writeback=False):
                for name, param in model.named_parameters():
                    torch.testing.assert_close(param, new_values[name], msg=lambda m: f"{when} {name}: {m}")
            # A sharded state dict round-trips, and a forward whose units stay
            # gathered for a backward that never comes changes neither.
            sharded = get_model_state_dict(model)
            local_parts = {name: value.local.clone() for name, value in sharded.items()}
            model(torch.randn(2, dim))
            after_forward = model.state_dict()
            for name, value in new_values.items():
                torch.testing.assert_close(after_forward[name], value, msg=lambda m: f"{when} after forward {name}: {m}")
            for name, value in get_model_state_dict(model).items():
                torch.testing.assert_close(value.local, local_parts[name], msg=lambda m: f"{when} sharded {name}: {m}")
            set_model_state_dict(model, sharded)
            with unshard_params(model, writeback=False):
                for name, param in model.named_parameters():
                    torch.testing.assert_close(param, new_values[name], msg=lambda m: f"{when} reloaded {name}: {m}")


def test_state_dicts_of_small_uneven_models_round_trip_in_place() -> None:
    run_distributed(_state_dicts_of_small_uneven_models, 2)


def _init_scenarios(rank: int, world_size: int) -> None:
    # Lazy init: the outermost unit is the root, every unit knows its name.
    model = nn.Sequential(MLP(8), MLP(8))
    fully_shard(model[0].in_proj)
    fully_shard(model[0].out_proj)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    names = {name: state.is_root for name, state in unit_states_under(model)}
    assert names == {"": True, "0.in_proj": False, "0.out_proj": False}, names
    assert get_state(model[0].in_proj).fqn == "0.in_proj" and get_state(model).fqn == "<root>"
    # A 3-D device mesh is refused by name.
    mesh = init_device_mesh("cpu", (world_size, 1, 1))
    with pytest.raises(ValueError, match=r"fully_shard\(MLP\): device_mesh must be 1-D or 2-D, got 3-D"):
        fully_shard(MLP(8), device_mesh=mesh)
    # A parameter replaced by a new object after sharding is refused at the
    # next forward, naming it (FSDP2 re-reads it at lazy init).
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    model.register_parameter("norm", nn.Parameter(torch.ones(3)))
    fully_shard(model[0])
    fully_shard(model)
    model.norm = nn.Parameter(torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="parameter 'norm' was replaced by another object after sharding"):
        model(torch.randn(2, 3))
    # Frozen parameters of a dtype without arithmetic (float8) beside
    # trainable fp32 ones, in a unit whose forward returns nothing.
    class Float8Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w8 = nn.Parameter(torch.zeros((16, 16), dtype=torch.float8_e4m3fn), requires_grad=False)
            self.w = nn.Parameter(torch.zeros(16, 16))

        def forward(self, x: object) -> None:
            return None

    unit = fully_shard(Float8Frozen())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert unit(0) is None
    assert any("returned no tensor that requires grad" in str(w.message) for w in caught)
    assert {h.layout.dtype for h in get_state(unit).handles} == {torch.float8_e4m3fn, torch.float32}


def test_lazy_init_names_units_and_init_misuse_is_refused_by_name() -> None:
    run_distributed(_init_scenarios, 2)
