"""Owns: the arithmetic of a gradient reduction: the settings it runs with
(``GradReduceSettings``), the dtype casts before and after the sum, and the
division that turns the sum into a mean, split around the collective.

Knows nothing of: which collective or transport carries the sum
(``comm.reduce_grad`` issues it, ``comm.finish_grad_reduction`` completes
it), flat parameters' layouts, modules, streams.

Public names: ``GradReduceSettings``, ``predivide_factor``,
``prepare_for_sum``, ``mean_of_sum``.

[Note: dividing around the reduction]
A gradient is averaged over every data-parallel rank (shard group times
replicate group). In full precision the sum is divided once, after the
reduction, so the mean is exact. A low-precision sum (fp16, bf16) can
overflow, so the division is split: a power of two near the square root of
the world size before the collective, the rest after it (powers of two
divide without rounding). The casts are part of it: the sum runs in
``reduce_dtype`` and the mean is cast to ``grad_dtype`` on the device that
reduced it. Pinned by test_gradient_reduction_is_the_mean_and_accumulates
(tests/handle/test_flat_param.py) and
test_mixed_precision_matches_a_low_precision_data_parallel_reference
(test_mixed_precision.py).

A unit's ``set_gradient_divide_factor`` replaces the world size in all of
this: the gradient is the sum divided by the factor, split the same way
around a low-precision sum (a factor of 1 divides by nothing). Partial sums
kept by ``set_requires_all_reduce(False)`` are pre-divided and post-divided
once, when the replica all-reduce finally runs. Pinned by
test_divide_factor_one_with_a_loss_scaled_by_the_world_size
(tests/training/test_reduction_controls.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .groups import ShardGroups

__all__ = ["GradReduceSettings", "predivide_factor", "prepare_for_sum", "mean_of_sum"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GradReduceSettings:
    """How one flat parameter's gradient is reduced."""

    # Reduce-scatter over the shard group, then (hybrid) all-reduce over the
    # replicate group; unsharded, all-reduce over the replicate group only.
    groups: ShardGroups
    # Dtype the sum is taken in (the mixed-precision policy's reduce dtype).
    reduce_dtype: torch.dtype
    # Dtype of the mean handed back: the parameters' own, or the reduce
    # dtype with ``keep_low_precision_grads``.
    grad_dtype: torch.dtype
    # What the sum is divided by (None: the data-parallel world size).
    divide_factor: float | None = None
    # Whether the replica all-reduce runs (False: the shard's partial sum is
    # kept for a later reduction; see comm/overrides.py).
    all_reduce: bool = True
    # A communication hook that replaces the whole reduction: (state, hook);
    # see [Note: communication hooks] in comm/overrides.py.
    comm_hook: tuple[Any, Callable[..., Any]] | None = None
    # Called on the summed shard after the replica all-reduce (FSDP2's
    # all-reduce hook), and the CUDA stream to run it in.
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None

    @property
    def divisor(self) -> float:
        """What the summed gradient is divided by in all."""
        if self.divide_factor is not None:
            return self.divide_factor
        return float(self.groups.data_parallel_world_size)

    @property
    def has_replicas(self) -> bool:
        """Whether the shard is replicated (hybrid, or unsharded over
        several ranks): only then is there a replica all-reduce to skip."""
        return self.groups.replicate_world_size > 1


def predivide_factor(reduce_dtype: torch.dtype, divisor: float) -> float:
    """What the gradient is divided by before the sum (see [Note: dividing
    around the reduction]); the rest of ``divisor`` after it."""
    if reduce_dtype in _LOW_PRECISION and divisor > 1:
        return float(2 ** round(math.log2(math.sqrt(divisor))))
    return 1.0


def prepare_for_sum(unsharded_grad: torch.Tensor, settings: GradReduceSettings) -> torch.Tensor:
    """``unsharded_grad`` in the reduce dtype, pre-divided: a new tensor when
    a cast is needed, else ``unsharded_grad`` itself, divided in place."""
    if unsharded_grad.dtype != settings.reduce_dtype:
        unsharded_grad = unsharded_grad.to(settings.reduce_dtype)
    predivide = predivide_factor(settings.reduce_dtype, settings.divisor)
    if predivide != 1.0:
        unsharded_grad.div_(predivide)
    return unsharded_grad


def mean_of_sum(summed_grad: torch.Tensor, settings: GradReduceSettings) -> torch.Tensor:
    """The mean from a reduced sum (divided by the rest of the divisor),
    cast to the gradient dtype where it lies: a tensor of its own. A sum
    that is one (a collective's output) is divided in place; a view of a
    larger one (a piece of a coalesced reduction) is divided into a new
    tensor, or copied where nothing divides or casts it."""
    divisor = settings.divisor
    postdivide = divisor / predivide_factor(settings.reduce_dtype, divisor)
    shared = not _owns_storage(summed_grad)
    if postdivide != 1.0:
        # The same division either way, element by element: the same bits.
        summed_grad = torch.div(summed_grad, postdivide) if shared else summed_grad.div_(postdivide)
        shared = False
    if summed_grad.dtype != settings.grad_dtype:
        return summed_grad.to(settings.grad_dtype)
    return summed_grad.clone() if shared else summed_grad


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where it is the whole of its storage, else a copy: what
    outlives the reduction (a sharded gradient, a kept partial sum, what a
    hook is shown) must not pin a coalesced reduction's whole output."""
    return tensor if _owns_storage(tensor) else tensor.clone()


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (contiguous) is the whole of its storage."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
