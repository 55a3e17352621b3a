"""Owns: the parity loop the ports of FSDP2's test scenarios share — any
model taking a float batch, a deep-copied single-process reference on the
global batch, the sharded model on this rank's slice, loss, full gradients
and full parameters compared after every step, ``zero_grad`` alternating
between setting to None and zeroing (as FSDP2's tests do).

Knows nothing of: which scenario is under test (callers pass how to build,
shard, run forward and compute the loss). See tests/peer/SCENARIOS.md.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .parity import Parity, assert_resharded, compare_full

Forward = Callable[[nn.Module, torch.Tensor], Any]
Loss = Callable[[Any], torch.Tensor]


def float_batch(step: int, dim: int, *, global_batch: int = 8, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """The global batch of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randn((global_batch, *shape, dim), generator=generator)


def local_slice(tensor: torch.Tensor) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank : (rank + 1) * per_rank]


def mean_square(output: Any) -> torch.Tensor:
    return output.float().square().mean()


def train_in_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], object],
    *,
    dim: int,
    steps: int = 3,
    forward: Forward = lambda model, x: model(x),
    loss: Loss = mean_square,
    make_batch: Callable[[int], torch.Tensor] | None = None,
    lr: float = 1e-2,
    atol: float = 2e-6,
    rtol: float = 1e-5,
    when: str = "",
    check_resharded: bool = True,
) -> tuple[nn.Module, nn.Module]:
    """Train ``build()`` sharded and unsharded side by side with Adam;
    raise on the first mismatch. Returns (sharded, reference)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=lr)
    parity = Parity(build=build, shard=lambda m: None, atol=atol, rtol=rtol, reference_optimizer=reference_optimizer)
    for step in range(steps):
        label = f"{when} step {step}"
        inputs = make_batch(step) if make_batch is not None else float_batch(step, dim)
        reference_loss = loss(forward(reference, inputs))
        reference_loss.backward()
        local_loss = loss(forward(model, local_slice(inputs)))
        local_loss.backward()
        mean_loss = local_loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(
            mean_loss / dist.get_world_size(), reference_loss.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{label} loss: {m}"
        )
        if check_resharded:
            assert_resharded(model)
        compare_full(model, reference, parity, label, grads=True)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        compare_full(model, reference, parity, f"{label} after step", grads=False)
    return model, reference
