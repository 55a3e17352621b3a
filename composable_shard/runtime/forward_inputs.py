"""Owns: what a unit's forward pre-hook does to its inputs — the device
check, the mixed-precision cast, and the identity whose backward tells when
backward is done with the unit's frozen flat parameters.

Knows nothing of: streams, collectives (it calls the unit's mechanics).

Public names: ``check_input_devices``, ``cast_inputs``,
``hook_inputs_for_frozen_reshard``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .nested_tensors import map_tensors
from .state import UnitState
from .labels import hook_label

__all__ = ["check_input_devices", "cast_inputs", "hook_inputs_for_frozen_reshard"]


def check_input_devices(state: UnitState, args: tuple, kwargs: dict) -> None:
    """Every tensor input must be on the unit's compute device."""
    expected = state.compute_device
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor) and not _same_device(value.device, expected):
            raise ValueError(
                f"fully_shard({state.fqn}): got an input on {value.device}, but the module computes on "
                f"{expected}. Move the inputs to {expected} before calling the model."
            )


def _same_device(device: torch.device, expected: torch.device) -> bool:
    if device.type != expected.type:
        return False
    return device.index is None or expected.index is None or device.index == expected.index


def cast_inputs(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating-point inputs in the mixed-precision ``param_dtype``, where
    the policy casts this unit's inputs (the root's, or every unit's)."""
    policy = state.config.mixed_precision
    if policy is None or policy.param_dtype is None:
        return args, kwargs
    if not (policy.cast_root_forward_inputs if state.is_root else policy.cast_forward_inputs):
        return args, kwargs
    dtype = policy.param_dtype

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return map_tensors(cast, args), map_tensors(cast, kwargs)


class _ReshardFrozenAfterInputGrad(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of
    those inputs exist, i.e. after every op of the unit that leads to them.

    [Note: resharding frozen flat parameters]
    A frozen flat parameter has no gradient, so no post-accumulate-grad hook
    tells when backward is done with it. It is resharded once this
    function's backward ran for every forward use and every trainable flat
    parameter of the unit was reduced (``UnitState.reshard_frozen_when_done``);
    uses whose inputs need no gradient never report, and the end of backward
    reshards those. A trainable flat parameter holding parameters frozen
    after sharding waits the same way. Pinned by
    tests/training/test_composition.py (frozen parameters freed before
    backward ends).
    """

    @staticmethod
    def forward(ctx: Any, state: UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        state: UnitState = ctx.state
        with hook_label(state, "post_backward_frozen"):
            state.pending_backward_uses -= 1
            state.reshard_frozen_when_done()
        return (None, *grads)


def hook_inputs_for_frozen_reshard(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Route the inputs that require grad through the identity above when
    the unit has frozen flat parameters to reshard in backward."""
    if not state.frozen_handles_to_reshard or not torch.is_grad_enabled():
        return args, kwargs
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    hooked = _ReshardFrozenAfterInputGrad.apply(state, *(flat[i] for i in positions))
    for position, tensor in zip(positions, hooked):
        flat[position] = tensor
    state.pending_backward_uses += 1
    return tree_unflatten(flat, spec)
