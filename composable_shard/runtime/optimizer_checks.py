"""Owns: what the optimizer step pre-hook refuses — an optimizer whose
update is not known to be elementwise stepping sharded parameters, and the
backward of a forward that an optimizer step came between — and the
registry of optimizers declared elementwise.

Knows nothing of: the lifecycle's gate (lifecycle.py calls it), hooks,
flattening.

Public names: ``register_elementwise_optimizer``, ``ELEMENTWISE_OPTIMIZERS``,
``refuse_unless_elementwise``, ``remember_step_while_held``,
``refuse_backward_after_step``, ``remember_step_after_pending_forward``.

[Note: optimizers over shards]
Each rank steps only its 1-D slice of every sharded parameter, so an
optimizer is right only if its update of an element depends on that
element's own gradient and state and on scalars equal on every rank (the
step count, lr): then stepping slices is stepping the whole tensor. That is
so for the ``torch.optim`` optimizers in ``ELEMENTWISE_OPTIMIZERS`` (checked
against their update rules in torch 2.9 to 2.13: momentum, moving averages,
AMSGrad's running max, Rprop's per-element step sizes, RAdam's rectification
and NAdam's momentum product are elementwise or scalars of the step count).
It is not so for ``LBFGS`` (dot products over all parameters), ``Adafactor``
(row and column factors of each matrix; on an empty local part it divides
by zero), ``Muon`` (orthogonalises each whole matrix); ``SparseAdam`` is
elementwise but needs sparse gradients, which a flat parameter never has.
Those and every optimizer not declared are refused before their step
changes anything, when they update a parameter of a sharded unit (NO_SHARD
units hold whole tensors: anything goes). The check is by exact type (a
subclass may override ``step``); ``register_elementwise_optimizer(cls)``
declares another. Pinned by tests/training/test_optimizer_checks.py.

[Note: optimizer step between forward and backward]
In a single process, ``optimizer.step()`` between a forward and its
backward changes parameters the graph saved, and the backward raises
autograd's "modified by an inplace operation". Here the step writes the
shards, and the backward would gather the new values and compute gradients
with them: silently wrong. So the step notes the forward it came after (the
tree's ``forward_order`` list, a new object at every root forward), and the
first pre-backward of that forward resets the tree and raises. A forward
whose backward never comes (evaluation under grad mode) is free to be
followed by a step: nothing is refused until a backward of it starts, and
the next root forward makes a new list, which ends the matter.
A backward of an earlier forward can return the tree to idle while the
latest forward's backward is still to come (forward A, forward B, A's
backward, step, B's backward): each pre-backward hook carries its forward's
number (``RootContext.forward_serial``), so the step knows whether the latest forward's backward started, and
remembers it if not. Pinned by tests/training/test_optimizer_checks.py.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, TypeVar

import torch

from .state import RootContext

__all__ = [
    "register_elementwise_optimizer",
    "ELEMENTWISE_OPTIMIZERS",
    "refuse_unless_elementwise",
    "remember_step_while_held",
    "refuse_backward_after_step",
    "remember_step_after_pending_forward",
]

# [Note: optimizers over shards]
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon", "SparseAdam")

_DECLARED: set[type] = set(ELEMENTWISE_OPTIMIZERS)
# Optimizers found to update no sharded parameter, with how many parameters
# they had then (add_param_group invalidates it).
_NOTHING_SHARDED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# The forward each tree was stepped after (its forward_order list).
_STEPPED_AFTER: weakref.WeakKeyDictionary[RootContext, list] = weakref.WeakKeyDictionary()

OptimizerClass = TypeVar("OptimizerClass", bound=type)


def register_elementwise_optimizer(optimizer_class: OptimizerClass) -> OptimizerClass:
    """Declare that ``optimizer_class`` (exactly that class, not its
    subclasses) updates every element of a parameter from that element's
    gradient and state and from scalars equal on every rank, so stepping
    each rank's shard is stepping the whole parameter. Returns the class
    (usable as a decorator). See [Note: optimizers over shards]."""
    if not isinstance(optimizer_class, type):
        raise TypeError(
            f"register_elementwise_optimizer: expected an optimizer class, got {type(optimizer_class).__name__}; "
            "pass type(optimizer)."
        )
    _DECLARED.add(optimizer_class)
    return optimizer_class


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def refuse_unless_elementwise(optimizer: torch.optim.Optimizer, contexts: Iterable[RootContext]) -> None:
    """Raise before the step if ``optimizer`` is not declared elementwise and
    updates a parameter of a sharded unit in ``contexts``."""
    if type(optimizer) in _DECLARED:
        return
    count = _param_count(optimizer)
    if _NOTHING_SHARDED.get(optimizer) == count:
        return
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for context in contexts:
        for unit in context.units:
            if not unit.groups.is_sharded:
                continue
            for handle in unit.handles:
                for info, param in zip(handle.layout.params, handle.orig_params):
                    if id(param) in stepped:
                        _raise_not_elementwise(optimizer, f"{unit.name_prefix}{info.fqn}")
    _NOTHING_SHARDED[optimizer] = count


def _raise_not_elementwise(optimizer: torch.optim.Optimizer, param_name: str) -> None:
    name = type(optimizer).__name__
    known = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    why = (
        f"{name} needs whole tensors or dot products over all parameters"
        if name in _NOT_ELEMENTWISE[:3]
        else "SparseAdam needs sparse gradients, which flat parameters never have"
        if name == "SparseAdam"
        else f"{name} is not known to update each element on its own"
    )
    raise RuntimeError(
        f"{name}.step() over parameter '{param_name}' of a sharded fully_shard unit: each rank steps only its "
        f"shard, which is right only for an optimizer whose update is elementwise; {why}. Known elementwise: "
        f"{known}; not elementwise: LBFGS, Adafactor, Muon. If {name}'s update of each element depends only on that "
        f"element's gradient and state and on scalars equal on every rank, declare it with "
        f"composable_shard.register_elementwise_optimizer({name}); otherwise keep its parameters out of sharded "
        "units (ShardingStrategy.NO_SHARD or ignored_states). Nothing was updated."
    )


def remember_step_while_held(context: RootContext, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer step updates the tree between a forward and its
    backward ([Note: optimizer step between forward and backward]). Only
    if it changes something: torch's optimizers skip parameters without a
    gradient, and then a single process's backward does not raise either."""
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"] if param.grad is not None}
    if any(id(param) in stepped for unit in context.units for handle in unit.handles for param in handle.orig_params):
        _STEPPED_AFTER[context] = context.forward_order


def refuse_backward_after_step(context: RootContext, reset: Callable[[RootContext], None]) -> None:
    """In a pre-backward: if an optimizer step came after this backward's
    forward, ``reset`` the tree and raise."""
    stepped_after = _STEPPED_AFTER.get(context)
    if stepped_after is None or stepped_after is not context.forward_order:
        return
    reset(context)
    raise RuntimeError(
        f"fully_shard({context.root.fqn}): backward of a forward that optimizer.step() was called after. The step "
        "changed parameters this forward used, so the gradients would not be those of the forward (a single "
        "process raises here too: 'one of the variables needed for gradient computation has been modified by an "
        "inplace operation'). Call backward before optimizer.step(), or run the forward again. The model has been "
        "reset to its sharded state and is usable."
    )


def remember_step_after_pending_forward(context: RootContext, optimizer: torch.optim.Optimizer) -> None:
    """A step with the tree idle: remember it if the latest forward was
    hooked for a backward that has not started ([Note: optimizer step
    between forward and backward])."""
    latest = context.forward_serial
    if context.hooked_forward == latest and context.backward_started_forward < latest:
        remember_step_while_held(context, optimizer)
