"""fully_shard inside torch's DistributedDataParallel wrapper, FSDP2's
test_ddp_A_fsdp_B_ddp_C: units on an inner module whose own submodule is
left out with ``ignored_states``, DDP over the whole model told to ignore
the parameters the units hold. DDP reduces the root's and the ignored
module's parameters, fully_shard the units'; the whole trains in parity
with one process on the global batch (every step: loss, full gradients
and parameters), with the ignored module given as a module or as its
parameters, in every strategy, with momentum SGD and Adam, and on an
uneven shard (dimension 7). 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from composable_shard import ShardingStrategy, fully_shard, is_fully_sharded

from tests.support.harness_pool import run_distributed
from tests.support.parity import Parity, step_and_compare


class Inner(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.sharded = nn.Linear(dim, dim)
        self.kept = nn.Linear(dim, dim)  # ignored by fully_shard: DDP's
        self.offset = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sharded(torch.tanh(self.kept(x))) - self.offset


class Outer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = Inner(dim)
        self.bias = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) + self.bias).pow(2).mean()


def _train(rank: int, world_size: int, strategy: str, ignored_as: str, dim: int) -> None:
    for make_optimizer in (
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=1e-2),
    ):
        torch.manual_seed(0)
        model = Outer(dim)
        reference = copy.deepcopy(model)
        kept = model.inner.kept
        ignored = [kept] if ignored_as == "module" else list(kept.parameters())
        fully_shard(model.inner.sharded, strategy=ShardingStrategy[strategy])
        fully_shard(model.inner, strategy=ShardingStrategy[strategy], ignored_states=ignored)
        assert not is_fully_sharded(kept) and not is_fully_sharded(model)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ["inner.offset", "inner.sharded.weight", "inner.sharded.bias"]
        )
        wrapped = DistributedDataParallel(model)
        optimizer, reference_optimizer = make_optimizer(wrapped.parameters()), make_optimizer(reference.parameters())
        parity = Parity(build=lambda: reference, shard=lambda module: None, reference_optimizer=reference_optimizer)
        for step in range(3):
            inputs = torch.randn(world_size, dim, dim, generator=torch.Generator().manual_seed(100 + step))
            loss = wrapped(inputs[rank])
            reference_loss = sum(reference(inputs[r]) for r in range(world_size)) / world_size
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            torch.testing.assert_close(mean_loss / world_size, reference_loss.detach(), atol=2e-6, rtol=1e-5)
            loss.backward()
            reference_loss.backward()
            step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"step {step}")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_units_inside_ddp_train_in_parity(strategy: str) -> None:
    run_distributed(_train, 2, strategy, "module", 8)
    run_distributed(_train, 2, strategy, "params", 7)
