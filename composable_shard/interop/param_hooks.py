"""Owns: refusing gradient hooks (``Tensor.register_hook``) on the original
parameters of a unit, which would never run: at registration, and before the
unit's next forward for hooks that got there another way.

Knows nothing of: the runtime's hooks and lifecycle, flattening (it reads a
unit's parameters and their names).

Public names: ``guard_param_hooks`` (a unit extension).

[Note: hooks on original parameters]
A unit computes with views of its flat parameter; the original parameters
only show this rank's shard between steps and are never part of autograd's
graph, so a hook registered on one with ``register_hook`` is silently never
called (FSDP2 ignores them too). Running it "as in a single process" would
need the full *reduced* gradient of that parameter, which exists nowhere
(each rank's unsharded gradient is its local batch's, and after the
reduce-scatter each rank holds a slice): an all-gather per hooked parameter
per step, and the hook's result sliced back. Refusing costs nothing, so
``register_hook`` on such a parameter raises at once (an instance attribute
shadows the method: no global patch, nothing on other tensors), naming the
parameter and what works instead: ``register_post_accumulate_grad_hook``
(runs once the reduced shard is in ``.grad``), or a hook on a tensor the
module computes. A hook that got there anyway (registered before
``fully_shard``, or through ``torch.Tensor.register_hook(param, fn)``) is
refused before the unit's next forward, before anything of the step runs,
so removing it (its handle's ``remove()``) makes the model usable again.
Pinned by tests/interop/test_param_hooks.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..runtime.state import TrainingState, UnitState, unit_states_under

__all__ = ["guard_param_hooks"]

_WHAT_TO_USE = (
    "use param.register_post_accumulate_grad_hook(fn) (it runs once the reduced, sharded gradient is in .grad; "
    "change param.grad there), or register a hook on a tensor the module computes (its output)"
)


def guard_param_hooks(state: UnitState) -> list[RemovableHandle]:
    """Unit extension: make ``register_hook`` on the unit's original
    parameters raise, and check before each of its forwards that none holds
    such a hook."""
    unit_name = type(state.module).__name__
    for handle in state.handles:
        for info, param in zip(handle.layout.params, handle.orig_params):
            # Strings only: the attribute travels with the parameter if it is
            # deep-copied or pickled.
            param.register_hook = functools.partial(  # type: ignore[method-assign]  # shadows the method on purpose
                _refuse_registration, f"{unit_name}.{info.fqn}"
            )
    check = functools.partial(_refuse_existing_hooks, state)
    return [module.register_forward_pre_hook(check, prepend=True) for module in state.members]


def _refuse_registration(param_name: str, hook: Callable[..., Any]) -> None:
    raise RuntimeError(
        f"register_hook on parameter '{param_name}' of a fully_shard unit: the unit computes with views of a flat "
        "parameter, so a hook on the original (sharded) parameter would never run and its gradient would be "
        f"silently unchanged. Instead, {_WHAT_TO_USE}."
    )


def _refuse_existing_hooks(state: UnitState, module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():
        return  # checked by the eager forwards around it
    if state.root_context is None:  # before lazy init: this is the outermost unit called
        units = [(f"{name}." if name else "", unit) for name, unit in unit_states_under(module)]
    elif state.is_root:
        units = [(unit.name_prefix, unit) for unit in state.root_context.units]
    elif state.root_context.root.training_state is TrainingState.FORWARD:
        return  # the root checked the whole tree before its forward started
    else:
        units = [(state.name_prefix, state)]  # called on its own
    for prefix, unit in units:
        for handle in unit.handles:
            for info, param in zip(handle.layout.params, handle.orig_params):
                if param._backward_hooks:
                    raise RuntimeError(
                        f"fully_shard: parameter '{prefix}{info.fqn}' has a hook registered "
                        "with register_hook (before fully_shard, or through torch.Tensor.register_hook), which would "
                        "never run: the unit computes with views of a flat parameter. Remove it (its handle's "
                        f"remove()); {_WHAT_TO_USE}. Nothing of this step ran; the model is usable."
                    )
