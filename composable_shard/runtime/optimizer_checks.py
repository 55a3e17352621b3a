"""Owns: what the optimizer step pre-hook refuses — an optimizer whose
update is not known to be elementwise stepping sharded parameters, a loss
scaler that decides its step from this rank's shards alone, and the
backward of a forward that an optimizer step came between — and the
registry of optimizers declared elementwise.

Knows nothing of: the lifecycle's gate (lifecycle.py calls it), hooks,
flattening.

Public names: ``register_elementwise_optimizer``, ``ELEMENTWISE_OPTIMIZERS``,
``refuse_unless_elementwise``, ``refuse_local_loss_scaler``, ``remember_step_while_held``,
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
Any other optimizer is taken to be per-parameter (its update of a
parameter reads that parameter's whole gradient and state: Muon,
Adafactor, Shampoo/SOAP, a user's own that reads shapes or norms): each of
its parameters of a unit is stepped whole, once per shard group, by an
owner rank ([Note: owner computes] in optim/owner_step.py) — under every
strategy, since NO_SHARD and one-rank units show flattened 1-D views too.
Refused at every step (before the first forward too, so the hooks are
registered by ``fully_shard``), before anything changes: ``LBFGS``, which
couples all parameters (over sharded units; NO_SHARD units hold whole
tensors, which it flattens anyway), and ``SparseAdam``, which needs sparse
gradients.
The elementwise check is by exact type (a subclass may override ``step``);
``register_elementwise_optimizer(cls)`` declares another. Pinned by
tests/runtime/test_optimizer_checks.py and tests/optim/.

[Note: optimizer step between forward and backward]
In a single process, ``optimizer.step()`` between a forward and its
backward changes parameters the graph saved, and the backward raises
autograd's "modified by an inplace operation". Here the step writes the
shards, and the backward would gather the new values and compute gradients
with them: silently wrong. So the step notes the latest forward it came
after (``RootContext.forward_serial``), and the first pre-backward of that
forward or an earlier one resets the tree and raises: also a second
backward through a graph kept with ``retain_graph=True`` after the first
backward and a step, which a single process refuses the same way. A forward
whose backward never comes (evaluation under grad mode) is free to be
followed by a step: nothing is refused until a backward of it starts, and
the next root forward has a larger number, which ends the matter.
A backward can return the tree to idle while a backward of the same or
an earlier forward is still to come (forward A, forward B, A's backward,
step, B's backward; or ``backward(retain_graph=True)``, step, backward): a
step with the tree idle is remembered too, and each pre-backward hook
carries its forward's number. Pinned by tests/runtime/test_optimizer_checks.py.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Callable, Iterable, TypeVar

import torch

from .state import RootContext, UnitState

__all__ = [
    "register_elementwise_optimizer",
    "ELEMENTWISE_OPTIMIZERS",
    "is_elementwise",
    "flattens_parameters",
    "refuse_coupling_optimizer",
    "refuse_local_loss_scaler",
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
# Optimizers no per-parameter schedule makes exact here, with why, and
# whether units that hold whole tensors on every rank (NO_SHARD, one-rank
# shard groups) are exact for them anyway.
_REFUSED: dict[type[torch.optim.Optimizer], tuple[str, bool]] = {
    torch.optim.LBFGS: (
        "LBFGS couples all parameters (dot products and a line search over every parameter at once), so neither "
        "a shard nor one whole parameter is enough to compute its step.",
        True,  # it flattens every parameter anyway: whole 1-D views are exact
    ),
    torch.optim.SparseAdam: ("SparseAdam needs sparse gradients, which the reduced gradients of a unit never are.", False),
}

_DECLARED: set[type] = set(ELEMENTWISE_OPTIMIZERS)
# The latest forward (RootContext.forward_serial) each tree was stepped after.
_STEPPED_AFTER: weakref.WeakKeyDictionary[RootContext, int] = weakref.WeakKeyDictionary()

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


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps each rank's slice ([Note: optimizers over
    shards]); any other per-parameter optimizer steps whole parameters on
    their owners (composable_shard/optim/)."""
    return type(optimizer) in _DECLARED


def flattens_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` reads every parameter as one flat vector
    (LBFGS): allowed only over whole tensors, which need no owner."""
    return isinstance(optimizer, torch.optim.LBFGS)


def refuse_coupling_optimizer(optimizer: torch.optim.Optimizer, units: Iterable[UnitState]) -> None:
    """Raise before the step, whatever step it is (before the first forward
    too), if ``optimizer`` is one that no per-parameter schedule makes exact
    and it updates a parameter of any unit in ``units``. Looked up at every
    step: an optimizer's parameter groups may change between steps."""
    if type(optimizer) in _DECLARED:
        return
    refusal = next((why for cls, why in _REFUSED.items() if isinstance(optimizer, cls)), None)
    if refusal is None:
        return
    reason, whole_is_exact = refusal
    stepped = _first_stepped_param(optimizer, (unit for unit in units if unit.groups.is_sharded or not whole_is_exact))
    if stepped is not None:
        _raise_refused(optimizer, stepped, reason)


def _first_stepped_param(optimizer: torch.optim.Optimizer, units: Iterable[UnitState]) -> str | None:
    """The name of the first parameter of ``units`` that ``optimizer``
    steps, or None."""
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for unit in units:
        for handle in unit.handles:
            for info, param in zip(handle.layout.params, handle.orig_params):
                if id(param) in stepped:
                    return f"{unit.name_prefix}{info.fqn}"
    return None


def _raise_refused(optimizer: torch.optim.Optimizer, param_name: str, reason: str) -> None:
    name = type(optimizer).__name__
    raise RuntimeError(
        f"{name}.step() over parameter '{param_name}' of a fully_shard unit: {reason} Optimizers whose update of a "
        "parameter reads only that parameter's own gradient and state (SGD, AdamW, Muon, Adafactor, Shampoo-style "
        f"preconditioners, ...) work on sharded units; for {name} keep its parameters out of sharded units "
        "(ShardingStrategy.NO_SHARD or ignored_states) or use one of those. Nothing was updated."
    )


# [Note: loss scaling over shards]
# ``torch.amp.GradScaler`` looks for inf/NaN in the gradients the optimizer
# holds and skips ``optimizer.step()`` where it finds one. Here each rank
# holds its shard of a sharded gradient: an overflow lands on one rank, that
# rank skips, the others step, and the ranks' parameters and scales diverge
# silently (DTensor's FSDP2 gradients agree on it; FSDP1 needs its
# ``ShardedGradScaler``). So a step called by a GradScaler that does not
# agree over a process group (``ShardedGradScaler`` keeps one in
# ``process_group``), over a parameter of a unit sharded over several ranks,
# raises, naming the scaler to use, at the first step: before any step, on
# every rank (no rank skips its first step unless its gradients overflowed).
# Found by the frames of the caller (GradScaler.step and _maybe_opt_step,
# which calls optimizer.step()): a few frames looked at per step.
# Pinned by tests/runtime/test_optimizer_checks.py.
_SCALER_CODES = frozenset((torch.amp.GradScaler.step.__code__, torch.amp.GradScaler._maybe_opt_step.__code__))
_FRAMES_TO_LOOK_AT = 8


def refuse_local_loss_scaler(optimizer: torch.optim.Optimizer, units: Callable[[], Iterable[UnitState]]) -> None:
    """Raise if ``optimizer.step()`` was called by a ``GradScaler`` that
    decides from this rank's gradients alone and ``optimizer`` updates a
    parameter of a unit in ``units()`` sharded over several ranks ([Note:
    loss scaling over shards])."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_TO_LOOK_AT):
        if frame is None:
            return
        if frame.f_code in _SCALER_CODES:
            scaler = frame.f_locals.get("self")
            # Sharded, or disabled (its step is the optimizer's, nothing decided).
            if scaler is None or hasattr(scaler, "process_group") or not scaler.is_enabled():
                return
            sharded = (unit for unit in units() if unit.groups.is_sharded and unit.groups.shard_world_size > 1)
            stepped = _first_stepped_param(optimizer, sharded)
            if stepped is not None:
                _raise_local_scaler(scaler, optimizer, stepped)
            return
        frame = frame.f_back


def _raise_local_scaler(scaler: object, optimizer: torch.optim.Optimizer, param_name: str) -> None:
    raise RuntimeError(
        f"{type(scaler).__name__}.step({type(optimizer).__name__}) over parameter '{param_name}' of a fully_shard "
        "unit: the scaler looks for inf/NaN in this rank's gradient shards only, so a rank whose shard overflowed "
        "would skip the step while the others take it, and the ranks would diverge. Use "
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (the same API; it agrees on skipping over "
        "all ranks). Nothing was updated."
    )


def remember_step_while_held(context: RootContext, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer step updates the tree between a forward and its
    backward ([Note: optimizer step between forward and backward]). Only
    if it changes something: torch's optimizers skip parameters without a
    gradient, and then a single process's backward does not raise either."""
    tree = context.param_ids
    if any(
        param.grad is not None and id(param) in tree for group in optimizer.param_groups for param in group["params"]
    ):
        _STEPPED_AFTER[context] = context.forward_serial


def refuse_backward_after_step(
    context: RootContext, forward_serial: int, unit_fqn: str, reset: Callable[[RootContext], None]
) -> None:
    """In a pre-backward of unit ``unit_fqn`` for the root forward numbered
    ``forward_serial``: if an optimizer step came after that forward,
    ``reset`` the tree and raise."""
    stepped_after = _STEPPED_AFTER.get(context)
    if stepped_after is None or forward_serial > stepped_after:
        return
    reset(context)
    raise RuntimeError(
        f"fully_shard({context.root.fqn}): backward (reaching unit '{unit_fqn}') of a forward that "
        "optimizer.step() was called after, also a second backward through a graph kept with retain_graph=True. "
        "The step changed parameters this forward used, so the gradients would not be those of the forward (a "
        "single process raises here too: 'one of the variables needed for gradient computation has been modified "
        "by an inplace operation'). Call every backward of a forward before optimizer.step(), or run the forward "
        "again. The model has been reset to its sharded state and is usable."
    )


def remember_step_after_pending_forward(context: RootContext, optimizer: torch.optim.Optimizer) -> None:
    """A step with the tree idle: remember it if a forward was hooked for
    backward, whose backward may still come, or come again through a
    retained graph ([Note: optimizer step between forward and backward])."""
    if context.hooked_forward:
        remember_step_while_held(context, optimizer)
