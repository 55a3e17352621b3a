"""What the owner step refuses before anything changes, each followed by
the model training on: a closure passed to an owner-stepped optimizer's
``step`` (it would run forward and backward while parameters are whole),
and tensor-parallel DTensor parameters (whole only across the tp ranks)."""

from __future__ import annotations

import pytest
import torch

from composable_shard import ShardingStrategy, fully_shard, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.optimizers import NewtonSchulzSGD, RowNormalizedSGD
from tests.support.parity import Parity, run_parity, shard_manually
from tests.support.tensor_parallel import build_stack, global_batch, local_loss, local_slice, mesh_2x2, parallelize


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, writeback=False):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _closure_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    optimizer = NewtonSchulzSGD(model.parameters())
    inputs, targets = batch(0)
    local = slice(rank * 4, (rank + 1) * 4)

    def closure() -> torch.Tensor:
        loss = lm_loss(model(inputs[local]), targets[local])
        loss.backward()
        return loss

    closure()
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"NewtonSchulzSGD\.step\(closure\) over parameters of fully_shard units.*"
                                           r"Call the closure .* yourself, then optimizer\.step\(\)\. Nothing was updated"):
        optimizer.step(closure)
    after = _snapshot(model)
    assert all(torch.equal(after[name], before[name]) for name in before), "a refused step changed parameters"
    optimizer.zero_grad()
    run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD),
                      make_optimizer=lambda m: RowNormalizedSGD(m.parameters()), steps=2))


def test_a_closure_is_refused_and_the_model_trains_on() -> None:
    run_distributed(_closure_refused, 2)


def _tensor_parallel_refused(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    model = parallelize(build_stack(), mesh["tp"])
    fully_shard(model, device_mesh=mesh["dp"])
    optimizer = NewtonSchulzSGD(model.parameters())
    x = local_slice(global_batch(0), mesh)
    local_loss(model(x), global_batch(0), mesh).backward()
    with unshard_params(model, writeback=False):
        before = {name: param.detach().full_tensor().clone() for name, param in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"NewtonSchulzSGD\.step\(\) over parameter '.*', a tensor-parallel DTensor"
                                           r".*Nothing was updated"):
        optimizer.step()
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            assert torch.equal(param.detach().full_tensor(), before[name]), f"{name} changed by a refused step"
    elementwise = torch.optim.SGD(model.parameters(), lr=0.1)
    elementwise.step()  # the model trains on with an elementwise optimizer


def test_tensor_parallel_parameters_are_refused_clearly() -> None:
    run_distributed(_tensor_parallel_refused, 4)
