"""Owns: the communication hooks shipped for ``register_comm_hook`` (FSDP1's
default and low-precision hooks, with their states), and what the plan may
know of them (``hook_reduce_dtype``).

Knows nothing of: units, flat parameters, streams (a hook runs wherever
the reduction is issued: [Note: communication hooks] in comm/overrides.py).

Public names: ``DefaultState``, ``LowPrecisionState``, ``allreduce_hook``,
``reduce_scatter_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``hook_reduce_dtype``, ``reduce_dtype_of_unit``, ``is_shipped_hook``.

The state names the group the hook reduces over: the unit's own (the
default group for a unit sharded over all ranks; the subgroup given to
``fully_shard`` otherwise). ``register_comm_hook(module, None, hook)`` with
one of these hooks builds that state for each unit from its own group
(controls/reduction.py). The mean is the sum divided by that group's
size, split around the sum as FSDP1 does (a power of two before, the rest
after), so a low-precision sum does not overflow. The compression hooks sum
in fp16 / bf16 and write the mean back in the gradient's dtype. Pinned by
tests/comm/test_comm_hooks.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import comm

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "hook_reduce_dtype",
    "reduce_dtype_of_unit",
    "is_shipped_hook",
]


class DefaultState:
    """The group a hook reduces over and the divisions around its sum."""

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        # FSDP1's split: the largest power of two p with p * p < world size
        # that divides it, before the sum; the rest after.
        predivide = 1
        while self.world_size % predivide == 0 and self.world_size / predivide > predivide:
            predivide *= 2
        self.gradient_predivide_factor = float(predivide)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor


class LowPrecisionState(DefaultState):
    """A ``DefaultState`` whose hook may cast the mean to ``parameter_type``
    (kept for FSDP1's signature; the mean is written in the gradient's
    dtype whatever it is)."""

    def __init__(self, process_group: ProcessGroup | None = None, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def _divide(tensor: torch.Tensor, factor: float) -> None:
    if factor > 1:
        tensor.div_(factor)


def _check_group(state: DefaultState, expected: int, what: str) -> None:
    # Called from a backward: a state naming a group of another size than
    # the unit's would fail inside the collective with a size error.
    if expected != state.world_size:
        raise ValueError(
            f"{what}: the state's process group has {state.world_size} ranks but the gradient is split for "
            f"{expected}; build the state with the group the unit was sharded over."
        )


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Unsharded units: ``grad`` becomes the mean over the state's group."""
    _divide(grad, state.gradient_predivide_factor)
    comm.all_reduce(grad, state.process_group, async_op=False)
    _divide(grad, state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Sharded units: ``output`` becomes this rank's chunk of the mean of
    ``grad`` over the state's group (``grad`` is scratch)."""
    _check_group(state, grad.numel() // max(output.numel(), 1), "reduce_scatter_hook")
    _divide(grad, state.gradient_predivide_factor)
    comm.reduce_scatter(output, grad, state.process_group, async_op=False)
    _divide(output, state.gradient_postdivide_factor)


def _low_precision_hook(dtype: torch.dtype, state: DefaultState, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    compressed = grad.to(dtype)
    if output is None:
        allreduce_hook(state, compressed)
        grad.copy_(compressed)
        return
    compressed_output = output if output.dtype == dtype else output.new_empty(output.shape, dtype=dtype)
    reduce_scatter_hook(state, compressed, compressed_output)
    if compressed_output is not output:
        output.copy_(compressed_output)


def fp16_compress_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Reduce the gradient in float16 (half the bytes of fp32): cast,
    pre-divide, sum over the state's group, post-divide, write back in the
    gradient's dtype."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """As ``fp16_compress_hook``, in bfloat16 (fp32's range, fewer digits)."""
    _low_precision_hook(torch.bfloat16, state, grad, output)


_SHIPPED_HOOKS: tuple[Callable[..., Any], ...] = (
    allreduce_hook,
    reduce_scatter_hook,
    fp16_compress_hook,
    bf16_compress_hook,
)
_HOOK_DTYPES: dict[Callable[..., Any], torch.dtype] = {
    fp16_compress_hook: torch.float16,
    bf16_compress_hook: torch.bfloat16,
}


def is_shipped_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is one of this module's hooks, which read a
    ``DefaultState`` (its group and divisions)."""
    return hook in _SHIPPED_HOOKS


def hook_reduce_dtype(hook: Callable[..., Any]) -> torch.dtype | None:
    """The dtype a shipped hook sums in (its compression buffer: the padded
    gradient and the shard in that dtype), for the plan; None for the
    full-precision hooks (they reduce in place, as the default reduction
    does) and for a user's hook, which is opaque."""
    return _HOOK_DTYPES.get(hook)


def reduce_dtype_of_unit(unit: Any) -> torch.dtype | None:
    """The dtype a unit's communication hook sums in, where the plan can
    know it (``hook_reduce_dtype``): ``plan.describe`` counts the
    compression buffers as a reduction in that dtype. None without a hook
    or for an opaque one (the plan then counts the unit's own dtypes: the
    hook's buffers are unknown to it)."""
    registered = unit.reduction_overrides.comm_hook
    return None if registered is None else hook_reduce_dtype(registered[1])
