"""Owns: the two-dimensional (dp x tp) parity recipe — a tiny residual MLP
stack whose blocks are parallelised with ColwiseParallel, RowwiseParallel and
SequenceParallel on the "tp" dimension of a 2-D mesh and sharded with
``fully_shard`` on "dp", trained side by side with a single-process reference
on the global batch, comparing loss and full parameters after every step.

Knows nothing of: which feature is under test (callers pass the sharding
arguments and the step options).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from composable_shard import fully_shard, unshard_params

DIM, HIDDEN, SEQ = 8, 16, 4


class TPBlock(nn.Module):
    """norm (SequenceParallel: Replicate params) -> up (Colwise: Shard(0)) ->
    relu -> down (Rowwise: weight Shard(1), bias Replicate), residual."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.checkpointed = checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class TPStack(nn.Module):
    def __init__(self, blocks: int = 2, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock(checkpointed) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_stack(blocks: int = 2, checkpointed: bool = False) -> TPStack:
    torch.manual_seed(0)
    return TPStack(blocks, checkpointed)


def block_plan() -> dict[str, Any]:
    """Sequence-parallel residual stream: inputs and outputs of every block
    are this tp rank's slice of the sequence (dim 1)."""
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(model: TPStack, tp_mesh: DeviceMesh) -> TPStack:
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan())
    return model


def mesh_2x2() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def global_batch(step: int, batch: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, SEQ, DIM, generator=generator)


def data_parallel_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this rank among the data-parallel ranks: the "dp"
    dimension, or every dimension but "tp" (a (replicate, shard, tp) mesh)."""
    names = mesh.mesh_dim_names
    if "dp" in names:
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    rank, size = 0, 1
    for name in names:
        if name != "tp":
            rank, size = rank * mesh[name].size() + mesh[name].get_local_rank(), size * mesh[name].size()
    return rank, size


def local_slice(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of a global batch: its dp rank's rows, its tp
    rank's sequence positions."""
    dp_rank, dp_size = data_parallel_coords(mesh)
    tp = mesh["tp"]
    rows = x.chunk(dp_size, dim=0)[dp_rank]
    return rows.chunk(tp.size(), dim=1)[tp.get_local_rank()]


def local_loss(out: torch.Tensor, global_x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's share of the global mean of out**2: the tp ranks' shares
    add up (tensor-parallel backward sums them), the dp ranks' are averaged
    by the gradient reduction."""
    rows = global_x.shape[0] // data_parallel_coords(mesh)[1]
    return out.float().pow(2).sum() / (rows * global_x.shape[1] * global_x.shape[2])


def reference_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's global value (collective over the whole mesh)."""
    with unshard_params(model):
        return {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            for name, param in model.named_parameters()
        }


@dataclass
class TPParity:
    """One 2-D parity run."""

    shard_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 2
    checkpointed: bool = False
    # Parameters frozen (requires_grad=False) before sharding, by name.
    frozen: tuple[str, ...] = ()
    # Per step: how many micro-batches (the first ones under no_sync).
    micro_batches: int = 1
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = (
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    )
    clip: float | None = None
    # Clip with torch.nn.utils.clip_grad_norm_ over the parameters instead
    # of composable_shard.clip_grad_norm_.
    torch_clip: bool = False
    # The dtype the reference computes forward and backward in (its master
    # weights stay fp32; see [Note: low-precision 2-D reference]).
    compute_dtype: torch.dtype | None = None
    atol: float = 1e-5
    rtol: float = 1e-5
    # Build the 2-D model on the meta device (fully_shard materialises it,
    # [Note: deferred initialisation] in units/materialize.py); the reference starts from
    # the values that gave it.
    meta_init: bool = False
    # Filled by the run: the norms clip_grad_norm_ returned (sharded, reference).
    norms: list[tuple[float, float]] = field(default_factory=list)


def run_tp_parity(parity: TPParity, mesh: DeviceMesh | None = None) -> list[float]:
    """Train the reference and the 2-D model side by side; assert parity of
    loss and full parameters after each step. Returns the losses."""
    from composable_shard import clip_grad_norm_, no_sync

    mesh = mesh if mesh is not None else mesh_2x2()
    reference = build_stack(checkpointed=parity.checkpointed)
    if parity.meta_init:
        with torch.device("meta"):
            model = TPStack(checkpointed=parity.checkpointed)
    else:
        model = copy.deepcopy(reference)
    parallelize(model, mesh["tp"])
    # After parallelize_module, which makes new parameters (requires_grad=True).
    for name in parity.frozen:
        reference.get_parameter(name).requires_grad_(False)
        model.get_parameter(name).requires_grad_(False)
    for block in model.blocks:
        fully_shard(block, **parity.shard_kwargs)
    fully_shard(model, **parity.shard_kwargs)
    if parity.meta_init:
        reference.load_state_dict(full_params(model))
    ref_opt = parity.make_optimizer([p for p in reference.parameters() if p.requires_grad])
    opt = parity.make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(parity.steps):
        ref_loss_total = 0.0
        loss_total = torch.zeros(())
        for micro in range(parity.micro_batches):
            x = global_batch(step * 10 + micro)
            ref_loss_total += _reference_backward(reference, x, parity) / parity.micro_batches
            local = local_slice(x, mesh)
            last = micro == parity.micro_batches - 1
            with (no_sync(model) if not last else _null()):
                loss = local_loss(model(local), x, mesh) / parity.micro_batches
                loss.backward()
            loss_total += loss.detach()
        dist.all_reduce(loss_total)  # tp shares add, dp ranks' means: / dp
        loss_value = loss_total.item() / data_parallel_coords(mesh)[1]
        assert abs(loss_value - ref_loss_total) <= parity.atol + parity.rtol * abs(ref_loss_total), (
            step,
            loss_value,
            ref_loss_total,
        )
        if parity.clip is not None:
            if parity.torch_clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), parity.clip)
            else:
                norm = clip_grad_norm_(model, parity.clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), parity.clip)
            parity.norms.append((norm.item(), ref_norm.item()))
            torch.testing.assert_close(norm, ref_norm, atol=parity.atol, rtol=parity.rtol)
        for name in parity.frozen:  # frozen: autograd gave it no gradient
            assert model.get_parameter(name).grad is None, name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        got = full_params(model)
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(
                got[name], expected.detach(), atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"step {step} {name}: {m}"
            )
        losses.append(loss_value)
    return losses


def _reference_backward(reference: nn.Module, x: torch.Tensor, parity: TPParity) -> float:
    """Forward and backward of the reference on the global batch; gradients
    accumulate into its fp32 ``.grad``.

    [Note: low-precision 2-D reference]
    With ``compute_dtype`` the reference runs a copy of its master weights
    cast to that dtype (as the sharded units compute) and adds the copy's
    gradients, cast up, to the masters'. The tensor-parallel reductions sum
    in another order than one process does, so the comparison uses the
    dtype's round-off (callers set the tolerances), with SGD so that a
    gradient's rounding moves a weight in proportion."""
    if parity.compute_dtype is None:
        loss = reference_loss(reference(x)) / parity.micro_batches
        loss.backward()
        return loss.item() * parity.micro_batches
    low = copy.deepcopy(reference).to(parity.compute_dtype)
    loss = reference_loss(low(x.to(parity.compute_dtype))) / parity.micro_batches
    loss.backward()
    for master, copy_param in zip(reference.parameters(), low.parameters()):
        if copy_param.grad is None:
            continue
        grad = copy_param.grad.float()
        master.grad = grad if master.grad is None else master.grad + grad
    return loss.item() * parity.micro_batches


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
