"""Owns: the hooks that drive one step — unit pre/post forward (the root's
pre-forward starts the step), pre-backward on the outputs, post-backward
once a flat parameter's gradient is accumulated, the end-of-backward
callback, the reset of a forward that raised — and their registration.
Each hook is a few lines: a transition and calls into the unit (runtime/state.py),
the lifecycle and the prefetch policy.

Knows nothing of: streams, devices, flattening details.

Public names: ``register_hooks``, ``call_as_forward``.

[Note: activation-checkpoint re-runs]
Activation checkpointing re-runs a unit's forward inside backward, which
``in_backward()`` recognises: the unit is then unsharded for its gradient
computation, and its post-forward neither reshards nor registers backward
hooks. The reentrant form runs the first forward under ``no_grad``: that
forward reshards like an eval forward, and the re-run unshards again inside
backward. Pinned by tests/training/test_composition.py.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..api import BackwardPrefetch
from ..handle import FlatParamHandle, pending_views
from .nested_tensors import scan_output
from .state import BETWEEN_STEPS, RootContext, TrainingState, UnitState
from .groups import GroupSteps, end_open_groups, group_method_hooks, register_group_forward_hooks
from .compiled_autograd import refuse_compiled_autograd
from .forward_inputs import cast_inputs, check_input_devices, hook_inputs_for_frozen_reshard
from .labels import hook_label
from .nested_backwards import defer_nested_reduction, note_backward_task, reduce_nested_deferred
from .optimizer_checks import refuse_backward_after_step
from .lifecycle import (
    end_forward_without_backward,
    enter_between_steps,
    in_backward,
    reset_after_error,
    return_tree_to_idle,
    start_root_forward,
)
from .partial_backward import backward_accumulates, hold_after_partial_backward, note_accumulating_backward
from .pending_grads import reduce_left_behind, show_waiting_grads
from .prefetch import followers, prefetch_in_backward, prefetch_in_forward
from .root import lazy_init
from .skipped_units import end_anchor_forward, gather_anchored, reduce_or_defer, reduce_skippable, stays_gathered
from .unit_controls import (
    check_unit_controls,
    end_explicit_unshard,
    end_explicit_unshards,
    finish_reductions_left_in_flight,
    keep_gathered_between_steps,
    keeps_after_forward,
)

__all__ = ["register_hooks", "call_as_forward"]


# ----------------------------------------------------------------- forward
def _pre_forward(state: UnitState, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    with hook_label(state, "pre_forward"):
        if state.root_context is None:
            lazy_init(state)
        context = state.context
        check_unit_controls(state, "forward")
        end_explicit_unshard(state)  # [Note: explicit unshard shows full parameters]
        if in_backward():  # [Note: activation-checkpoint re-runs]
            if state.training_state in BETWEEN_STEPS:
                state.transition(TrainingState.PRE_BACKWARD, *BETWEEN_STEPS)
                context.scheduler.mark_shards_written()  # [Note: what a lane waits for]
            state.unshard(wait=True)
            return args, kwargs
        if state.forward_method_depth and state.training_state is TrainingState.FORWARD:
            args, kwargs = cast_inputs(state, args, kwargs)  # [Note: forward methods]
            return hook_inputs_for_frozen_reshard(state, args, kwargs)
        if state.is_root:
            start_root_forward(context)
            check_input_devices(state, args, kwargs)
            context.start_forward_order()
        elif context.root.training_state is not TrainingState.FORWARD:  # called on its own
            enter_between_steps(context.units, "forward", inside_a_step="skip", keep_gathered=True)
            context.scheduler.mark_shards_written()  # [Note: what a lane waits for]
            # A forward of its own: its backward is not one of an earlier
            # step's ([Note: optimizer step between forward and backward]).
            context.forward_serial += 1
        state.transition(TrainingState.FORWARD, *BETWEEN_STEPS)  # from HELD: it already ran in this forward
        context.record_forward(state)
        state.unshard(wait=True, followers=followers(state, forward=True))
        gather_anchored(state)  # [Note: units that some ranks skip]
        prefetch_in_forward(state)
        args, kwargs = cast_inputs(state, args, kwargs)
        return hook_inputs_for_frozen_reshard(state, args, kwargs)


def _post_forward(state: UnitState, module: nn.Module, args: tuple, output: Any) -> Any:
    with hook_label(state, "post_forward"):
        if in_backward() or state.forward_method_depth:  # the method's own end hooks it
            return output
        grad_enabled = torch.is_grad_enabled()
        hooked = grad_enabled and _register_pre_backward_hooks(state, output)
        if state.is_root:
            end_open_groups(state.context)  # [Note: grouped units] in groups.py
        _end_forward(state, grad_enabled, hooked)
        return output


def _end_forward(state: UnitState, grad_enabled: bool, outputs_hooked: bool) -> None:
    """The unit's forward ended (a group's: after its last module)."""
    # The root's backward comes first, so its parameters stay gathered;
    # so do the last unit's ([Note: the last unit stays gathered]), and
    # those set_reshard_after_forward(False) keeps (runtime/unit_controls.py).
    keeps_unsharded = keeps_after_forward(state, grad_enabled)
    if grad_enabled and not outputs_hooked:
        keeps_unsharded = len(state.trainable_handles) > 0  # [Note: outputs without a hookable tensor]
    if stays_gathered(state) or (keeps_unsharded and grad_enabled):  # [Note: units that some ranks skip]
        state.hold_for_backward()
    elif keeps_unsharded:  # set_reshard_after_forward(False) without autograd
        keep_gathered_between_steps(state)
    else:
        state.transition(TrainingState.IDLE, TrainingState.FORWARD)
        # Inside the root's forward the next unit's all-gather follows:
        # its buffer must not reuse this one ([Note: what a lane waits for]).
        state.reshard(defer_free=state.context.root.training_state is TrainingState.FORWARD)
    end_anchor_forward(state)  # [Note: units that some ranks skip]
    if not grad_enabled and state.is_root:
        end_forward_without_backward(state.context)


def _after_forward_raised(state: UnitState, module: nn.Module, args: tuple, output: Any) -> None:
    """Registered with ``always_call``: after a normal forward the unit has
    left ``FORWARD`` (no-op); a forward that raised left it there.

    [Note: a forward that raised]
    A unit whose forward raised is resharded and idle again as the
    exception leaves it, and the root resets its whole tree (what the next
    forward would otherwise do), so a loop that catches the exception finds
    the model between steps at once: state dicts, ``unshard_params``,
    ``clip_grad_norm_`` and the optimizer work before the next forward.
    Pinned by tests/training/test_loop_recovery.py.
    """
    if state.training_state is not TrainingState.FORWARD or in_backward() or state.forward_method_depth:
        return None
    with hook_label(state, "forward_raised"):
        if state.is_root:
            reset_after_error(state.context)
        else:
            state.reshard()
            state.transition(TrainingState.IDLE, TrainingState.FORWARD)
    return None


def call_as_forward(state: UnitState, method: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``method`` (a unit's method other than ``forward``, registered
    with ``register_forward_method``) between the unit's forward hooks, as
    ``module(...)`` runs ``forward``; called from the unit's own forward it
    is a plain call (the parameters are already unsharded).

    [Note: forward methods]
    The method may call the module itself (a language model's ``generate``
    calls ``self(...)`` once a token): those forwards are part of the
    method's, so while ``state.forward_method_depth`` counts a call in
    progress the module's own hooks only cast inputs, and the forward ends
    (reshard, or hold for backward, output hooked) once, when the method
    returns; a group's forward likewise waits for it (runtime/groups.py).
    A method that raises leaves the unit resharded and idle, as a forward
    that raised does. Pinned by tests/runtime/test_forward_methods.py.
    """
    if state.is_group:
        pre, post, raised = group_method_hooks(state)
    elif state.training_state is TrainingState.FORWARD:
        return method(module, *args, **kwargs)
    else:
        pre, post, raised = (functools.partial(step, state) for step in (_pre_forward, _post_forward, _after_forward_raised))
    args, kwargs = pre(module, args, kwargs)
    state.forward_method_depth += 1
    try:
        output = method(module, *args, **kwargs)
    except BaseException:
        state.forward_method_depth -= 1
        raised(module, args, None)
        raise
    state.forward_method_depth -= 1
    return post(module, args, output)


# ---------------------------------------------------------------- backward
def _register_pre_backward_hooks(state: UnitState, output: Any) -> bool:
    """Hook every output tensor that requires grad; whether there was one.

    [Note: outputs without a hookable tensor]
    A forward under grad mode that returns no tensor requiring grad where
    ``scan_output`` can find it, from a unit with trainable parameters, may
    still get a gradient through a hidden tensor (an opaque object, a side
    channel on a module). No pre-backward hook can run, so the unit stays
    gathered as the root does (held for backward), with a warning naming
    what could not be looked into. A unit with nothing to train whose output
    needs no grad reshards at once, even as the root or the last unit: no
    backward can reach it, so nothing would end a kept state. Pinned by
    tests/runtime/test_output_structures.py.
    """
    scan = scan_output(output)
    hook = functools.partial(_pre_backward, state, state.context.forward_serial)
    for tensor in scan.tensors:
        tensor.register_hook(hook)
    if scan.tensors:
        state.context.hooked_forward = state.context.forward_serial
    if not scan.tensors and state.trainable_handles:
        hidden = f" (could not look into: {sorted(set(scan.opaque))})" if scan.opaque else ""
        warnings.warn(
            f"fully_shard({state.fqn}): its forward returned no tensor that requires grad{hidden}, "
            f"output type {type(output).__qualname__}. Its parameters stay unsharded until the end of the "
            "next backward, in case a gradient reaches them through a tensor hidden from composable_shard. "
            "Return the tensors in tuples, lists, dicts, dataclasses or namedtuples, or run the forward "
            "under torch.no_grad() when no backward follows.",
            stacklevel=2,
        )
    # len, not bool(list): dynamo in torch 2.11 cannot trace the builtin bool
    # of a list, a graph break in every compiled block's post-forward hook.
    return len(scan.tensors) > 0


def _pre_backward(state: UnitState, forward_serial: int, grad: torch.Tensor) -> None:
    # [Note: optimizer step between forward and backward]
    refuse_backward_after_step(state.context, forward_serial, state.fqn, reset_after_error)
    refuse_compiled_autograd(state.context, state.fqn, reset_after_error)  # [Note: compiled autograd]
    if state.training_state is TrainingState.PRE_BACKWARD:
        return  # another output of the same unit already did it
    with hook_label(state, "pre_backward"):
        context = state.context
        check_unit_controls(state, "backward")
        end_explicit_unshard(state)  # [Note: explicit unshard shows full parameters]
        if backward_accumulates(state):
            _queue_finalize_once(context)
        else:  # [Note: backwards that accumulate nothing of ours]
            hold_after_partial_backward(context)
        state.transition(TrainingState.PRE_BACKWARD, *BETWEEN_STEPS, TrainingState.POST_BACKWARD)
        note_backward_task(state)  # [Note: reentrant checkpoints inside a unit]
        for handle in state.handles:  # [Note: zero_grad while no_sync gradients wait] in handle/pending_views.py
            pending_views.take_user_changes(handle, name_prefix=state.name_prefix, accumulated=False)
        # [Note: trimming the host heap in backward] (runtime/host_memory.py)
        if context.host_memory_trimmer is not None and not torch.compiler.is_compiling():
            gathered = sum(h.unsharded_bytes for h in state.handles if h.needs_unshard_storage)
            context.host_memory_trimmer.unit_backward_starts(gathered)
        state.unshard(wait=True, followers=followers(state, forward=False), reuse_views=True)
        gather_anchored(state)  # [Note: units that some ranks skip]
        context.scheduler.unit_backward_starts()  # [Note: backward prefetch on CPU]
        prefetch_in_backward(state, BackwardPrefetch.BACKWARD_PRE)


def _post_backward(state: UnitState, handle: FlatParamHandle, flat_param: torch.Tensor) -> None:
    with hook_label(state, "post_backward"):
        _queue_finalize_once(state.context)
        if not defer_nested_reduction(state, handle):  # [Note: reentrant checkpoints inside a unit]
            _reduce_after_backward(state, handle)


def _reduce_after_backward(state: UnitState, handle: FlatParamHandle, *, prefetch: bool = True) -> None:
    if reduce_or_defer(state, handle):  # [Note: units that some ranks skip]
        # From any state (no check to make): a unit whose outputs had no
        # hookable tensor never ran its pre-backward.
        state.training_state = TrainingState.POST_BACKWARD
        state.reshard_frozen_when_done()
        if prefetch:
            prefetch_in_backward(state, BackwardPrefetch.BACKWARD_POST)


def _queue_finalize_once(context: RootContext) -> None:
    if not context.post_backward_callback_queued:
        finish_reductions_left_in_flight(context)  # [Note: a backward that is not the last]
        end_explicit_unshards(context)  # [Note: explicit unshard shows full parameters]
        context.post_backward_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_finalize_backward, context))
        # A backward starts: shards may have changed since the forward
        # ([Note: what a lane waits for] in runtime/scheduler.py).
        context.scheduler.mark_shards_written()


def _finalize_backward(context: RootContext) -> None:
    """End of backward: finish every reduction (which sets ``.grad``),
    reshard every unit, reset states for the next step."""
    with hook_label(context.root, "finalize_backward"):
        note_accumulating_backward(context)  # [Note: a step after backwards that accumulated nothing]
        # [Note: reentrant checkpoints inside a unit]
        reduce_nested_deferred(context, functools.partial(_reduce_after_backward, prefetch=False))
        reduce_skippable(context)  # [Note: units that some ranks skip]
        reduce_left_behind(context)  # [Note: no_sync gradients of units that did not run]
        show_waiting_grads(context)  # [Note: zero_grad while no_sync gradients wait] in handle/pending_views.py
        return_tree_to_idle(context, discard_grads=False)
        context.run_deferred_grad_hooks()


# -------------------------------------------------------------- registration
def register_hooks(state: UnitState) -> None:
    """Attach the unit's forward hooks and its flat parameters'
    post-accumulate-grad hooks; every handle is kept in the state."""
    module = state.module
    if state.is_group:  # [Note: grouped units] in groups.py
        steps = GroupSteps(_pre_forward, _register_pre_backward_hooks, _end_forward, _after_forward_raised)
        state.module_hooks.extend(register_group_forward_hooks(state, steps))
    else:
        # Prepended, as FSDP2's: the unit's pre-forward (unshard, input
        # casts) runs before pre-hooks registered earlier, whatever the
        # order of the calls: a composable checkpoint applied before
        # fully_shard saves the cast inputs (tests/training/test_mixed_precision.py).
        state.module_hooks.append(
            module.register_forward_pre_hook(functools.partial(_pre_forward, state), with_kwargs=True, prepend=True)
        )
        state.module_hooks.append(module.register_forward_hook(functools.partial(_post_forward, state)))
        state.module_hooks.append(
            module.register_forward_hook(functools.partial(_after_forward_raised, state), always_call=True)
        )
    for handle in state.handles:  # also frozen ones: they may be unfrozen later
        # Weak: see [Note: hooks on tensors hold the unit weakly].
        hook: Callable[[torch.Tensor], None] = functools.partial(
            _post_backward_of, weakref.ref(state), weakref.ref(handle)
        )
        registered = handle.register_post_accumulate_grad_hook(hook)
        if registered is not None:
            state.module_hooks.append(registered)


# [Note: hooks on tensors hold the unit weakly]
# A hook on a tensor lives in autograd's C++ structures, which the garbage
# collector cannot see into; the post-accumulate-grad hook sits on the
# handle's own flat parameter, so holding the state and the handle strongly
# would close a cycle no collection frees (the model, its memory and its
# process groups would outlive ``dist.destroy_process_group``). The module's
# forward hooks and ``module.__dict__`` keep them alive while the model is.
# Pinned by tests/runtime/test_model_lifetime.py.
def _post_backward_of(
    state_ref: weakref.ReferenceType[UnitState],
    handle_ref: weakref.ReferenceType[FlatParamHandle],
    flat_param: torch.Tensor,
) -> None:
    state, handle = state_ref(), handle_ref()
    if state is not None and handle is not None:
        _post_backward(state, handle, flat_param)
