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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def predivide_factor(reduce_dtype: torch.dtype, world_size: int) -> float:
    """What the gradient is divided by before the sum (see [Note: dividing
    around the reduction]); the rest of ``world_size`` after it."""
    if reduce_dtype in _LOW_PRECISION and world_size > 1:
        return float(2 ** round(math.log2(math.sqrt(world_size))))
    return 1.0


def prepare_for_sum(unsharded_grad: torch.Tensor, settings: GradReduceSettings) -> torch.Tensor:
    """``unsharded_grad`` in the reduce dtype, pre-divided: a new tensor when
    a cast is needed, else ``unsharded_grad`` itself, divided in place."""
    if unsharded_grad.dtype != settings.reduce_dtype:
        unsharded_grad = unsharded_grad.to(settings.reduce_dtype)
    predivide = predivide_factor(settings.reduce_dtype, settings.groups.data_parallel_world_size)
    if predivide != 1.0:
        unsharded_grad.div_(predivide)
    return unsharded_grad


def mean_of_sum(summed_grad: torch.Tensor, settings: GradReduceSettings) -> torch.Tensor:
    """The mean from a reduced sum (divided in place by the rest of the
    world size), cast to the gradient dtype where it lies."""
    world_size = settings.groups.data_parallel_world_size
    postdivide = world_size / predivide_factor(settings.reduce_dtype, world_size)
    if postdivide != 1.0:
        summed_grad.div_(postdivide)
    return summed_grad.to(settings.grad_dtype)
