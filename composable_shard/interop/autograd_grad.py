"""Owns: refusing ``torch.autograd.grad`` (and ``torch.autograd.backward``'s
``inputs=``) over the original parameters of a unit, which are not in
autograd's graph and would silently get no gradient.

Knows nothing of: the runtime's hooks and lifecycle, flattening (it reads a
unit's original parameters and their names).

Public names: ``track_unit_params`` (a unit extension), ``wrap_grad``,
``wrap_backward`` (used by install.py, which installs the wrappers).

[Note: autograd.grad over original parameters]
A unit computes with views of its gathered flat parameter; the original
parameters hold this rank's shard between steps and are never part of the
graph. ``torch.autograd.grad(loss, model.parameters(), allow_unused=True)``
therefore returned None for every one of them, and nothing of ours ran:
when none of its inputs is in the graph, autograd runs no node and no hook,
so the runtime cannot see the call. Putting the parameters into the graph
would make autograd call every ``register_hook`` hook with None and every
post-accumulate-grad hook twice on each ordinary backward. So the two entry
points that take ``inputs`` are wrapped while a sharded model exists
([Note: wrapping torch's functions] in install.py; nothing changes for calls
whose inputs are not such parameters: one lookup per input) and raise,
naming the parameter and what works instead. Pinned by
tests/interop/test_gradient_penalty.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.autograd
from torch.utils.hooks import RemovableHandle

from ..runtime.state import UnitState

__all__ = ["track_unit_params", "wrap_grad", "wrap_backward"]

# An attribute on the parameter, not a weak registry: a weak reference to a
# parameter makes torch.utils.swap_tensors (module.to() with swapping on)
# refuse it; the attribute travels with the parameter like its __dict__.
_NAME_ATTRIBUTE = "_composable_shard_unit_param"
_tracking = False


def track_unit_params(state: UnitState) -> list[RemovableHandle]:
    """Unit extension: remember the unit's original parameters. Registers no hook."""
    global _tracking
    unit_name = type(state.module).__name__
    for handle in state.handles:
        for info, param in zip(handle.layout.params, handle.orig_params):
            setattr(param, _NAME_ATTRIBUTE, f"{unit_name}.{info.fqn}")
    _tracking = True
    return []


def _refuse_original_params(inputs: Any, entry: str) -> Any:
    """Raise if ``inputs`` holds an original parameter of a unit; returns
    ``inputs`` (a one-shot iterable as a tuple, so that torch still sees it)."""
    if inputs is None or not _tracking or isinstance(inputs, torch.autograd.graph.GradientEdge):
        return inputs
    if isinstance(inputs, torch.Tensor):
        candidates: Iterable[Any] = (inputs,)
    elif isinstance(inputs, dict):
        candidates = inputs.values()
    else:
        if not isinstance(inputs, (list, tuple)):
            inputs = tuple(inputs)  # a generator such as model.parameters()
        candidates = inputs
    for tensor in candidates:
        name = getattr(tensor, _NAME_ATTRIBUTE, None) if isinstance(tensor, torch.Tensor) else None
        if name is not None:
            raise RuntimeError(
                f"{entry} with parameter '{name}' of a fully_shard unit among its inputs: the unit computes with "
                "views of a flat parameter, so the original (sharded) parameter is not in autograd's graph and "
                "would get no gradient. Call loss.backward() instead (the reduced, sharded gradient lands in "
                "param.grad; register_post_accumulate_grad_hook sees it), or differentiate with respect to "
                "tensors the module computes. Nothing ran; the model is usable."
            )
    return inputs


def wrap_grad(torch_grad: Callable[..., Any]) -> Callable[..., Any]:
    """The guarded ``torch.autograd.grad``: refuses original parameters among
    ``inputs``, then calls ``torch_grad`` (torch's own) unchanged."""

    @functools.wraps(torch_grad)
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return torch_grad(outputs, _refuse_original_params(inputs, "torch.autograd.grad"), *args, **kwargs)

    return grad


def wrap_backward(torch_backward: Callable[..., Any]) -> Callable[..., Any]:
    """The guarded ``torch.autograd.backward`` (which ``Tensor.backward``
    calls): refuses original parameters in ``inputs``, then calls
    ``torch_backward`` (torch's own) unchanged."""

    @functools.wraps(torch_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        # ``inputs`` is the sixth parameter; Tensor.backward passes it by keyword.
        if "inputs" in kwargs:
            kwargs["inputs"] = _refuse_original_params(kwargs["inputs"], "backward(inputs=...)")
        elif len(args) > 5:
            args = args[:5] + (_refuse_original_params(args[5], "backward(inputs=...)"),) + args[6:]
        return torch_backward(*args, **kwargs)

    return backward
