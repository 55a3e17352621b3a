"""Owns: the user-facing configuration types of ``fully_shard``.

Knows nothing of: everything else (no tensors, no modules, no process groups).

Public names: ``ShardingStrategy``, ``BackwardPrefetch``, ``MixedPrecision``,
``CPUOffload``. Their meanings follow PyTorch FSDP's types of the same names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload"]


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are split."""

    # Parameters, gradients and optimizer state sharded; parameters are
    # resharded after forward and all-gathered again for backward (ZeRO-3).
    FULL_SHARD = enum.auto()
    # As FULL_SHARD, but parameters stay unsharded from forward until the end
    # of backward (ZeRO-2): one all-gather per step instead of two.
    SHARD_GRAD_OP = enum.auto()
    # Nothing sharded; gradients are all-reduced (DDP semantics).
    NO_SHARD = enum.auto()
    # FULL_SHARD inside a shard group, replicated across the replicate group.
    HYBRID_SHARD = enum.auto()
    # SHARD_GRAD_OP inside a shard group, replicated across the replicate group.
    HYBRID_SHARD_ZERO2 = enum.auto()

    @property
    def reshards_after_forward(self) -> bool:
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


class BackwardPrefetch(enum.Enum):
    """When backward issues the all-gather of the unit it needs next."""

    # Before the current unit's gradient computation (more overlap, one more
    # unsharded unit alive).
    BACKWARD_PRE = enum.auto()
    # After the current unit's gradient computation (less memory).
    BACKWARD_POST = enum.auto()


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers.

    ``None`` for a dtype means "keep the parameter's own dtype".
    """

    # Dtype the parameters are all-gathered and computed in; the sharded
    # parameter in its original dtype stays the optimizer's master copy.
    param_dtype: torch.dtype | None = None
    # Dtype gradients are reduced in (defaults to ``param_dtype``).
    reduce_dtype: torch.dtype | None = None
    # Dtype buffers are cast to.
    buffer_dtype: torch.dtype | None = None
    # Keep gradients in the low precision after reduction instead of
    # upcasting them to the parameter's dtype.
    keep_low_precision_grads: bool = False
    # Cast floating-point forward inputs of every unit to ``param_dtype``.
    cast_forward_inputs: bool = False
    # Cast floating-point forward inputs of the root to ``param_dtype``.
    cast_root_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded parameters and gradients on CPU between uses."""

    offload_params: bool = False
