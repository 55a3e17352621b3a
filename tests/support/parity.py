"""Owns: the parity recipe — train a sharded model and a deep-copied
single-process reference on the global batch side by side, and compare loss,
full gradients and full parameters after every step.

Knows nothing of: which feature is under test (callers pass how to shard,
how to run a step, and the optimizer).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard, unshard_params
from composable_shard.runtime.state import unit_states_under

from .models import batch, lm_loss

StepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@dataclass
class Parity:
    """One parity run: how to build, shard, step and optimise."""

    build: Callable[[], nn.Module]
    shard: Callable[[nn.Module], object]
    steps: int = 3
    step_fn: StepFn = plain_step
    reference_step_fn: StepFn = plain_step
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adamw
    # Build the optimizer on the unsharded model, before fully_shard.
    optimizer_before_shard: bool = False
    # Data-parallel rank and size (differs from the global ones only when a
    # test shards over a subgroup).
    dp_rank: int | None = None
    dp_size: int | None = None
    global_batch: int = 8
    # Where the models compute (the batch is moved there).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    atol: float = 2e-6
    rtol: float = 1e-5
    compared: list[str] = field(default_factory=list)


def assert_resharded(model: nn.Module) -> None:
    """No unsharded parameter storage may stay allocated between steps."""
    for name, state in unit_states_under(model):
        for handle in state.handles:
            held = handle.unsharded_storage_bytes()
            if held:
                raise AssertionError(f"unit '{name}' still holds {held} bytes of unsharded parameters")


def run_parity(parity: Parity) -> list[float]:
    """Train both models; raise on the first mismatch. Returns the losses."""
    dp_rank = dist.get_rank() if parity.dp_rank is None else parity.dp_rank
    dp_size = dist.get_world_size() if parity.dp_size is None else parity.dp_size
    torch.manual_seed(0)
    model = parity.build().to(parity.device)
    reference = copy.deepcopy(model)
    if parity.optimizer_before_shard:
        optimizer = parity.make_optimizer(model)
        parity.shard(model)
    else:
        parity.shard(model)
        optimizer = parity.make_optimizer(model)
    reference_optimizer = parity.make_optimizer(reference)
    losses = []
    for step in range(parity.steps):
        inputs, targets = (t.to(parity.device) for t in batch(step, parity.global_batch))
        reference_loss = parity.reference_step_fn(reference, inputs, targets)
        local = slice(dp_rank * parity.global_batch // dp_size, (dp_rank + 1) * parity.global_batch // dp_size)
        loss = parity.step_fn(model, inputs[local], targets[local])
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
        torch.testing.assert_close(mean_loss, reference_loss, atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"step {step} loss: {m}")
        assert_resharded(model)
        compare_full(model, reference, parity, f"step {step} after backward", grads=True)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"step {step} after optimizer step", grads=False)
        losses.append(reference_loss.item())
    return losses


def compare_full(model: nn.Module, reference: nn.Module, parity: Parity, when: str, *, grads: bool) -> None:
    """Full parameters (and gradients) of ``model`` equal ``reference``'s."""
    reference_params = dict(reference.named_parameters())
    with unshard_params(model, with_grads=grads, writeback=False):
        for name, param in model.named_parameters():
            expected = reference_params[name]
            torch.testing.assert_close(
                param.detach(), expected.detach(), atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"{when}, parameter {name}: {m}"
            )
            if not grads:
                continue
            if expected.grad is None:
                if param.grad is not None and param.grad.count_nonzero():
                    raise AssertionError(f"{when}: {name} has a gradient, the reference has none")
                continue
            if param.grad is None:
                raise AssertionError(f"{when}: {name} has no gradient, the reference has one")
            torch.testing.assert_close(
                param.grad, expected.grad, atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"{when}, gradient of {name}: {m}"
            )
            parity.compared.append(name)


def step_and_compare(
    model: nn.Module, reference: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], parity: Parity, when: str
) -> None:
    """Compare parameters and gradients (``when``), step and zero every
    optimizer, then compare parameters again ("``when`` after optimizer step")."""
    compare_full(model, reference, parity, when, grads=True)
    for optimizer in optimizers:
        optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad()
    compare_full(model, reference, parity, f"{when} after optimizer step", grads=False)


def hybrid_groups(world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups for hybrid sharding tests: 2x2 at 4 ranks,
    1 x world_size otherwise. Every rank creates every group."""
    shard_size = 2 if world_size == 4 else 1
    rank = dist.get_rank()
    shard_group = replicate_group = None
    for start in range(0, world_size, shard_size):
        group = dist.new_group(list(range(start, start + shard_size)))
        if rank in range(start, start + shard_size):
            shard_group = group
    for offset in range(shard_size):
        group = dist.new_group(list(range(offset, world_size, shard_size)))
        if rank % shard_size == offset:
            replicate_group = group
    return shard_group, replicate_group  # type: ignore[return-value]  # this rank is in one of each


def shard_manually(strategy: ShardingStrategy, **kwargs: object):
    """How to shard a TinyGPT: each block, then the root, all with ``strategy``."""

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy, **kwargs)
        fully_shard(model, strategy=strategy, **kwargs)

    return shard
