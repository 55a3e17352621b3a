"""Owns: the hooks that drive one step — root pre-forward (lazy init), unit
pre/post forward, pre-backward on the outputs, post-backward once a flat
parameter's gradient is accumulated, the end-of-backward callback — and
prefetching by the recorded forward order.

Knows nothing of: flattening details (it calls the handle and the scheduler).

Public names: ``register_hooks``, ``lazy_init``, ``reshard_unit``,
``unshard_unit``, ``reshard_held_units``, ``in_backward``, ``call_as_forward``,
``backward_prefetch_point``.

[Note: activation-checkpoint re-runs]
Activation checkpointing re-runs a unit's forward inside backward. Such a
re-run is recognised by the autograd engine running a graph task
(``in_backward()``): the unit is then unsharded for its gradient computation,
and its post-forward neither reshards nor registers backward hooks. The
reentrant form runs the first forward under ``no_grad``: that forward reshards
like an eval forward, and the re-run unshards again inside backward; the
flat parameter's post-accumulate-grad hook reduces afterwards as usual.

[Note: held for backward]
A forward with autograd on ends with some units still gathered for the
backward it expects: the root, the unit that ran last (see [Note: the last
unit stays gathered]) and, under strategies that do not reshard after
forward, every unit. Such a unit is in state ``HELD_FOR_BACKWARD``: its
unsharded buffer is kept, but its owners show the original parameters (the
shards) again, so outside a unit's forward and backward the user, the
optimizer and every utility see shards only. The state ends in one of three
ways:

- the backward comes: the unit's pre-backward finds the buffer gathered (no
  second all-gather) and moves it to ``PRE_BACKWARD``; the end of backward
  resets every unit it did not reach;
- anything else comes first: ``reshard_held_units`` frees every gathered
  buffer of the tree (prefetched ones too), waits for what the lanes still
  do, and, with CPU offload, for the device's copies from and to the pinned
  shards, and moves the units to ``IDLE``. Every entry point that reads or
  changes the parameters outside a step calls it first: the root's
  pre-forward (and the forward of a unit called on its own), the optimizer
  step (a global ``Optimizer`` step pre-hook, for optimizers that hold
  parameters of the tree), ``unshard_params``, ``clip_grad_norm_`` and every
  state-dict entry point. The buffer may be stale by then (the optimizer
  wrote the shards), and a dropped forward's graph may be freed without any
  hook running, so nothing waits for autograd to end the state;
- a backward of that forward's output comes after all (two forwards then
  one backward, or a backward after a state dict was taken): pre-backward
  unshards again from the shards, into the same storage the forward's saved
  views alias, so the gradients are right.

Resharding is local (no collective), so ending the state on one rank and
not on another cannot hang; the all-gathers that follow run on every rank
that makes the same calls.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils._pytree import tree_flatten, tree_unflatten

from .api import BackwardPrefetch
from .handle import FlatParamHandle
from .nested_tensors import map_tensors, scan_output
from .scheduler import Scheduler
from .state import BETWEEN_STEPS, RootContext, TrainingState, UnitState, raise_internal, unit_states_under

__all__ = [
    "register_hooks",
    "lazy_init",
    "reshard_unit",
    "unshard_unit",
    "reshard_held_units",
    "in_backward",
    "call_as_forward",
    "backward_prefetch_point",
]

logger = logging.getLogger(__name__)

# Every root's context, for the optimizer step pre-hook (weak: a deleted
# model drops its context).
_ROOT_CONTEXTS: weakref.WeakSet[RootContext] = weakref.WeakSet()
# The process-wide optimizer step pre-hook, registered at the first lazy init.
_OPTIMIZER_STEP_PRE_HOOK: RemovableHandle | None = None


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _hook_label(state: UnitState, hook: str) -> Iterator[None]:
    """Profiler label, debug log, and a logged error (autograd hides hook
    tracebacks) for one hook run. The label is only built and recorded while
    a profiler or debug logging is on: a ``record_function`` costs tens of
    microseconds, and a step runs four hooks per unit."""
    profiling = _profiler_enabled()
    if profiling or logger.isEnabledFor(logging.DEBUG):
        label = f"composable_shard::{hook} ({state.fqn})"
        logger.debug("%s", label)
    with torch.profiler.record_function(label) if profiling else contextlib.nullcontext():
        try:
            yield
        except Exception:
            rank = dist.get_rank() if dist.is_initialized() else 0
            logger.error(
                "composable_shard::%s (%s) failed on rank %d in state %s",
                hook, state.fqn, rank, state.training_state.name,
            )
            raise


def _profiler_enabled() -> bool:
    # Private but present in every torch this package supports (>= 2.4).
    # Under torch.compile a constant False: dynamo cannot trace this query's
    # bool result, and would break the graph once more per hook
    # (tests/test_compile.py counts the breaks).
    return not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled()


# ------------------------------------------------------------------ lazy init
def lazy_init(state: UnitState) -> RootContext:
    """Make ``state`` the root of its tree (idempotent): one scheduler and
    one forward-order record shared by every unit below it."""
    if state.root_context is not None and state.root_context.root is state:
        return state.root_context
    named_units = list(unit_states_under(state.module))
    units = [unit for _, unit in named_units]
    context = RootContext(
        state,
        units,
        Scheduler(state.compute_device, limit_all_gathers=state.config.limit_all_gathers),
    )
    for name, unit in named_units:
        unit.root_context = context
        unit.fqn = name or "<root>"
    _ROOT_CONTEXTS.add(context)
    _register_optimizer_step_pre_hook_once()
    logger.debug("composable_shard: lazy init of root %s with %d units", type(state.module).__name__, len(units))
    return context


# -------------------------------------------------------- unshard / reshard
def unshard_unit(state: UnitState, *, wait: bool) -> None:
    """Issue the unit's all-gathers (no-op where already unsharded); with
    ``wait``, make compute wait and point the owners at unsharded views."""
    scheduler = _scheduler(state)
    for handle in state.handles:
        scheduler.unshard(handle, functools.partial(_launch_unshard, handle))
    if wait:
        for handle in state.handles:
            scheduler.wait_for_unshard(handle)
            # Views must be autograd views of the flat parameter even when
            # built from a backward hook, where grad mode is off.
            with torch.enable_grad():
                handle.use_unsharded_views()


def _launch_unshard(handle: FlatParamHandle, async_op: bool) -> Any:
    return handle.unshard(async_op=async_op)


def reshard_unit(state: UnitState, *, hold: bool = False) -> None:
    """Free every unsharded buffer of the unit and show the shards again
    (``hold``: as ``Scheduler.free_unsharded``)."""
    scheduler = _scheduler(state)
    for handle in state.handles:
        _reshard_handle(scheduler, handle, hold=hold)


def _reshard_handle(scheduler: Scheduler, handle: FlatParamHandle, *, hold: bool = False) -> None:
    """Show the shard again; the scheduler frees the unsharded buffer, after
    marking compute's last use of it (see [Note: what a lane waits for] in
    scheduler.py): every free of a buffer a lane allocated goes through here."""
    scheduler.wait_for_unshard(handle)
    handle.reshard(free_storage=False)
    if handle.unsharded_storage_bytes():
        scheduler.free_unsharded(handle, handle.free_unsharded_storage, hold=hold)


def reshard_held_units(units: Iterable[UnitState]) -> None:
    """End ``HELD_FOR_BACKWARD`` in every tree ``units`` belong to: free
    every gathered buffer and make the shards safe to change. A no-op for a
    tree inside a forward or backward. See [Note: held for backward]."""
    contexts = {id(unit.root_context): unit.root_context for unit in units if unit.root_context is not None}
    for context in contexts.values():
        held = [unit for unit in context.units if unit.training_state is TrainingState.HELD_FOR_BACKWARD]
        if not held or not _is_between_steps(context):
            continue
        with _hook_label(context.root, "reshard_held_units"):
            context.scheduler.wait_for_all()
            for unit in context.units:
                for handle in unit.handles:
                    _reshard_handle(context.scheduler, handle)  # also what forward prefetch left gathered
            for unit in held:
                unit.transition(TrainingState.IDLE, TrainingState.HELD_FOR_BACKWARD)
            _synchronize_host_copies(context)


def _is_between_steps(context: RootContext) -> bool:
    return (
        not in_backward()
        and not context.post_backward_callback_queued
        and all(unit.training_state in BETWEEN_STEPS for unit in context.units)
    )


def _prefetch(unit: UnitState | None) -> None:
    if unit is not None and unit.handles:
        unshard_unit(unit, wait=False)


def _context(state: UnitState) -> RootContext:
    if state.root_context is None:
        raise_internal(state, "used before lazy init")
    return state.root_context  # type: ignore[return-value]  # raise_internal never returns


def _scheduler(state: UnitState) -> Scheduler:
    return _context(state).scheduler


# ----------------------------------------------------------------- forward
def _pre_forward(state: UnitState, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    with _hook_label(state, "pre_forward"):
        if state.root_context is None:
            lazy_init(state)
        if in_backward():  # [Note: activation-checkpoint re-runs]
            if state.training_state in BETWEEN_STEPS:
                state.transition(TrainingState.PRE_BACKWARD, *BETWEEN_STEPS)
                _scheduler(state).mark_shards_written()  # [Note: what a lane waits for]
            unshard_unit(state, wait=True)
            return args, kwargs
        context = _context(state)
        if state.is_root:
            args, kwargs = _root_pre_forward(state, args, kwargs)
        elif context.root.training_state is not TrainingState.FORWARD:
            reshard_held_units(context.units)  # called on its own: [Note: held for backward]
            context.scheduler.mark_shards_written()  # [Note: what a lane waits for]
        # From HELD_FOR_BACKWARD: the unit already ran in this forward.
        state.transition(TrainingState.FORWARD, *BETWEEN_STEPS)
        if state not in context.forward_order:
            context.forward_order.append(state)
        unshard_unit(state, wait=True)
        if state.config.forward_prefetch:
            _prefetch(context.next_in(context.previous_forward_order, state, +1))
        args, kwargs = _cast_inputs(state, args, kwargs, is_root=state.is_root)
        return _hook_inputs_for_frozen_reshard(state, args, kwargs)


def _root_pre_forward(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    context = _context(state)
    busy = [unit for unit in context.units if unit.training_state not in BETWEEN_STEPS]
    if busy and not context.post_backward_callback_queued and all(
        unit.training_state is TrainingState.FORWARD for unit in busy
    ):
        # The previous forward raised (user code, or a misuse reported from a
        # hook) and left its units in FORWARD; no backward can follow it.
        _reset_after_error(context)
        busy = []
    if busy or context.post_backward_callback_queued:
        _reset_after_error(context)
        raise RuntimeError(
            f"fully_shard({state.fqn}): forward called while the previous backward has not finished "
            f"(units still in backward: {[unit.fqn for unit in busy[:4]]}). Finish backward (or call it on every output) before "
            "the next forward; the model has been reset to its sharded state and is usable."
        )
    reshard_held_units(context.units)  # [Note: held for backward]
    for unit in context.units:
        for handle in unit.handles:
            handle.writeback_orig_params(name_prefix=unit.name_prefix)
    # The optimizer, the user and this write-back wrote shards on compute:
    # the step's first all-gather comes after ([Note: what a lane waits for]).
    context.scheduler.mark_shards_written()
    _check_input_devices(state, args, kwargs)
    if context.forward_order:
        context.previous_forward_order = context.forward_order
    context.forward_order = []
    return args, kwargs


def _check_input_devices(state: UnitState, args: tuple, kwargs: dict) -> None:
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


def _cast_inputs(state: UnitState, args: tuple, kwargs: dict, *, is_root: bool) -> tuple[tuple, dict]:
    policy = state.config.mixed_precision
    if policy is None or policy.param_dtype is None:
        return args, kwargs
    if not (policy.cast_root_forward_inputs if is_root else policy.cast_forward_inputs):
        return args, kwargs
    dtype = policy.param_dtype

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return map_tensors(cast, args), map_tensors(cast, kwargs)


def _post_forward(state: UnitState, module: nn.Module, args: tuple, output: Any) -> Any:
    with _hook_label(state, "post_forward"):
        if in_backward():  # [Note: activation-checkpoint re-runs]
            return output
        grad_enabled = torch.is_grad_enabled()
        # The root's backward comes first, so its parameters stay gathered;
        # so do the last unit's (see [Note: the last unit stays gathered]).
        keeps_unsharded = grad_enabled and (
            state.is_root
            or not state.config.strategy.reshards_after_forward
            or _backward_starts_with(state)
        )
        if grad_enabled and not _register_pre_backward_hooks(state, output):
            # [Note: outputs without a hookable tensor]
            keeps_unsharded = len(state.trainable_handles) > 0
        if keeps_unsharded:  # [Note: held for backward]
            state.transition(TrainingState.HELD_FOR_BACKWARD, TrainingState.FORWARD)
            for handle in state.handles:
                handle.hide_unsharded_views()
        else:
            state.transition(TrainingState.IDLE, TrainingState.FORWARD)
            # Inside the root's forward the next unit's all-gather follows:
            # its buffer must not reuse this one ([Note: what a lane waits for]).
            reshard_unit(state, hold=_context(state).root.training_state is TrainingState.FORWARD)
        if not grad_enabled and state.is_root:
            # No backward will come: free what forward prefetch left behind.
            context = _context(state)
            for unit in context.units:
                reshard_unit(unit)
            _synchronize_host_copies(context)
        return output


def _backward_starts_with(state: UnitState) -> bool:
    """Whether ``state`` ran last in the previous forward (not the root).

    [Note: the last unit stays gathered]
    Backward starts with the unit that ran last in forward, right after the
    loss: resharding it after its forward only to all-gather it again at
    once costs an all-gather that nothing can overlap (on gloo, 20-30 ms of
    waiting for a 3 MB unit on a busy machine). So, from the second step on,
    the unit that ran last in the previous forward keeps its parameters
    gathered, as the root does; its pre-backward finds them ready, and its
    post-backward (or the end of backward) reshards it. The memory held
    longer is one unit's parameters, during the part of forward after that
    unit (head and loss), which stays below the peak at the start of
    backward, where the unit is gathered anyway. Like the root's, its
    parameters are then held for a backward that may not come (see
    [Note: held for backward]).
    """
    order = _context(state).previous_forward_order
    return len(order) > 0 and order[-1] is state and not state.is_root


# ---------------------------------------------------------------- backward
def _register_pre_backward_hooks(state: UnitState, output: Any) -> bool:
    """Hook every output tensor that requires grad; whether there was one.

    [Note: outputs without a hookable tensor]
    When a forward under grad mode returns no tensor that requires grad
    where ``scan_output`` can find it (see [Note: hooking arbitrary outputs]
    in nested_tensors.py) although the unit has trainable parameters, a
    gradient may still reach the unit through a tensor it cannot see: one
    kept in an opaque object, or stored on a module as a side channel. No
    pre-backward hook can run then, so the unit keeps its parameters
    unsharded after forward, as the root does: a backward that reaches them
    finds them valid (the flat parameter's post-accumulate-grad hook reduces
    and reshards as usual), and the end of backward reshards them if none
    does. The cost is one unit's parameters held until then, with a warning
    naming the unit and what could not be looked into. Like every unit held
    for a backward, it is released when anything else comes first (see
    [Note: held for backward]); a backward of that forward that reaches the
    unit only through the hidden tensor after that finds its parameters
    freed, as it does after an eval forward in between.

    A unit with nothing to train whose output requires no grad (a frozen
    unit on inputs that need none, such as a frozen embedding) is resharded
    at once, even as the root or the last unit: no backward can reach its
    parameters (autograd records no op of it), so nothing would end a kept
    state.
    """
    scan = scan_output(output)
    hook = functools.partial(_pre_backward, state)
    for tensor in scan.tensors:
        tensor.register_hook(hook)
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


def _pre_backward(state: UnitState, grad: torch.Tensor) -> None:
    if state.training_state is TrainingState.PRE_BACKWARD:
        return  # another output of the same unit already did it
    with _hook_label(state, "pre_backward"):
        context = _context(state)
        _queue_finalize_once(context)
        state.transition(TrainingState.PRE_BACKWARD, *BETWEEN_STEPS, TrainingState.POST_BACKWARD)
        # [Note: trimming the host heap in backward] (CPU only)
        if context.host_memory_trimmer is not None and not torch.compiler.is_compiling():
            context.host_memory_trimmer.unit_backward_starts(sum(h.unsharded_bytes for h in state.handles))
        unshard_unit(state, wait=True)
        if state.compute_device.type == "cpu":  # [Note: backward prefetch on CPU]
            context.scheduler.wait_for_reductions_holding_inputs()
        if backward_prefetch_point(state) is BackwardPrefetch.BACKWARD_PRE:
            _prefetch(context.next_in(context.forward_order, state, -1))


def _post_backward(state: UnitState, handle: FlatParamHandle, flat_param: torch.Tensor) -> None:
    with _hook_label(state, "post_backward"):
        context = _context(state)
        _queue_finalize_once(context)
        if not state.skip_grad_sync:
            context.scheduler.reduce(
                functools.partial(_launch_reduce, handle),
                functools.partial(_finish_reduction, context, handle),
                finish_on_lane=handle.offload_params,  # downloads off compute: [Note: lane fences]
            )
        if not handle.has_frozen_params:  # else see [Note: resharding frozen flat parameters]
            _reshard_handle(context.scheduler, handle)
        state.reduced_handles.add(id(handle))
        if len(state.reduced_handles) == len(state.trainable_handles):
            state.training_state = TrainingState.POST_BACKWARD
            _maybe_reshard_frozen(state)
            if backward_prefetch_point(state) is BackwardPrefetch.BACKWARD_POST:
                _prefetch(context.next_in(context.forward_order, state, -1))


def backward_prefetch_point(state: UnitState) -> BackwardPrefetch | None:
    """Where in backward the unit issues the all-gather of the unit that
    backward reaches next: at its pre-backward (``BACKWARD_PRE``), after its
    gradient reduction was issued and it resharded (``BACKWARD_POST``), or
    not at all.

    [Note: backward prefetch on CPU]
    On CPU ``BACKWARD_PRE`` prefetches at the ``BACKWARD_POST`` point.
    Prefetching at the pre-backward makes the next unit's gathered buffer
    live through the whole gradient computation of this unit, whose end is
    the peak of backward: there autograd holds this unit's per-parameter
    gradients and the padded flat gradient they are concatenated into, while
    the previous unit's reduction is still in flight. On CUDA that buffer
    buys overlap on a separate stream; on CPU, gloo runs the all-gather in
    its own thread and, until it completes, also holds a flat copy of the
    whole output. An allocation profile of the 326M GPT on 2 ranks (gloo,
    16 blocks of 75 MiB) showed both at the peak (the concatenation of
    ``blocks.1``'s gradient): 1,001 MiB above the step's start against
    FSDP1's 851 MiB, whose all-gathers and reduce-scatters on CPU are
    synchronous (so it holds the prefetched buffer but neither gloo's copy
    nor a reduction in flight). Prefetching after the reduction is issued
    moves the all-gather's buffer and gloo's copy past the peak, where this
    unit's parameters and gradient are already freed; the all-gather then
    runs beside the reduction instead of beside compute.

    That leaves the reduction in flight: on gloo's message path an in-place
    all-reduce of the previous unit's padded gradient, as large as the unit.
    So on CPU a unit's pre-backward, once its own all-gather was waited,
    also finishes the reduction in flight if it still holds its padded
    gradient (not through shared memory, which copied it out when issued).
    The reduction was issued before that all-gather and ran beside it, and
    an all-reduce moves about twice an all-gather's bytes, so the wait is
    about one all-gather's time per unit; in exchange the backward's peak
    holds one unit's parameters and its gradient, below FSDP1's (which also
    holds the unit its BACKWARD_PRE prefetched). Through shared memory the
    reduction keeps running beside the next unit's backward, which costs
    only its output shard. ``plan`` replays the same order (``step_peak``'s
    ``prefetch_after_reduction``). Measured again at 326M (16 x 1280, n_head
    16): our step's worst moment 813 MiB above its start (the prefetch
    after ``blocks.1``), FSDP1's 851 MiB; the plan's peak equals the
    profile's (2,619 MiB with parameters and optimizer state).

    What the two changes cost in time, measured on a quiet machine (each
    change switched separately, interleaved with FSDP1 in one run; our
    median step over FSDP1's): through gloo at 7.4M (8 x 256) 0.89-0.94x
    with both, 0.86-0.87x with neither, 0.92-0.94x with either alone (two
    runs each); through shared memory 0.73-0.74x with both, 0.72x with
    neither. At 326M through gloo (one run each, 2 rounds of 2 steps) both
    0.88x at a peak of 3,088 MB per rank (FSDP1 3,219), neither 0.98x at
    3,346 MB (FSDP1 3,117), the prefetch move alone 1.00x at 3,274 MB, the
    wait alone 1.08x at 3,210 MB. So both stay: about 5% of a small model's
    gloo step, nothing measurable at 326M or through shared memory, and the
    lowest peak.
    """
    prefetch = state.config.backward_prefetch
    if prefetch is BackwardPrefetch.BACKWARD_PRE and state.compute_device.type == "cpu":
        return BackwardPrefetch.BACKWARD_POST
    return prefetch


class _ReshardFrozenAfterInputGrad(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of
    those inputs exist, i.e. after every op of the unit that leads to them.

    [Note: resharding frozen flat parameters]
    A frozen flat parameter has no gradient, so no post-accumulate-grad hook
    tells when backward is done with it. It is still needed by every op whose
    gradient flows to the unit's inputs or to its trainable parameters, so it
    is resharded once both happened for every forward use: this function's
    backward ran for each use, and every trainable flat parameter of the unit
    was reduced. Uses whose inputs need no gradient never report; the
    end-of-backward callback reshards those. A trainable flat parameter that
    holds frozen parameters (frozen after sharding) waits the same way: its
    frozen parameters' uses send no gradient into it, so its own gradient
    may be complete before they ran ([Note: changes to original parameters]
    in flat_param.py).
    """

    @staticmethod
    def forward(ctx: Any, state: UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        state: UnitState = ctx.state
        with _hook_label(state, "post_backward_frozen"):
            state.pending_backward_uses -= 1
            _maybe_reshard_frozen(state)
        return (None, *grads)


def _hook_inputs_for_frozen_reshard(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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


def _maybe_reshard_frozen(state: UnitState) -> None:
    """See [Note: resharding frozen flat parameters]."""
    if state.pending_backward_uses == 0 and len(state.reduced_handles) == len(state.trainable_handles):
        scheduler = _scheduler(state)
        for handle in state.frozen_handles_to_reshard:
            _reshard_handle(scheduler, handle)


def _launch_reduce(handle: FlatParamHandle, async_op: bool) -> Any:
    return handle.reduce_grad(async_op=async_op)


def _finish_reduction(context: RootContext, handle: FlatParamHandle, reduced: Any) -> None:
    """The handle's sharded gradient is final: show it in ``.grad`` and run
    the user's post-accumulate-grad hooks.

    [Note: user post-accumulate-grad hooks]
    The original parameters never take part in autograd here (forward and
    backward use views of the unsharded flat parameter), so hooks a user
    registers on them with ``register_post_accumulate_grad_hook`` would never
    run. They run here instead, once per backward that reduces the handle
    (not inside ``no_sync``, where no gradient is final), after the
    reduction, with ``.grad`` holding this rank's part (empty where the rank
    holds none): handles in the order their reductions finish (backward
    order), parameters in reverse layout order. An "optimizer in backward"
    that steps and zeroes a parameter from its hook works, since nothing
    reads the shard or the sharded gradient again in this backward. Torch
    keeps the hooks in ``Tensor._post_accumulate_grad_hooks`` (None or an
    ordered dict); reading it per parameter is the only cost without hooks.
    With CPU offload the gradients reach host memory only at the end of
    backward, so the hooks run there, after the host's wait.
    """
    handle.finish_grad_reduction(reduced)
    if any(param._post_accumulate_grad_hooks for param in handle.orig_params):
        if context.offloads_params:
            context.handles_with_deferred_grad_hooks.append(handle)
        else:
            _run_user_grad_hooks(handle)
            context.scheduler.mark_shards_written()  # an optimizer in backward: [Note: what a lane waits for]


def _run_user_grad_hooks(handle: FlatParamHandle) -> None:
    """See [Note: user post-accumulate-grad hooks]."""
    for param, requires_grad in zip(reversed(handle.orig_params), reversed(handle.param_requires_grad)):
        hooks = param._post_accumulate_grad_hooks
        if hooks and requires_grad and param.requires_grad:  # a frozen parameter gets no gradient, no hook
            for hook in tuple(hooks.values()):
                hook(param)


def _queue_finalize_once(context: RootContext) -> None:
    if not context.post_backward_callback_queued:
        context.post_backward_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_finalize_backward, context))
        # A backward starts: shards may have changed since the forward
        # ([Note: what a lane waits for] in scheduler.py).
        context.scheduler.mark_shards_written()


def _finalize_backward(context: RootContext) -> None:
    """End of backward: finish every reduction (which sets ``.grad``),
    reshard every unit, reset states for the next step."""
    with _hook_label(context.root, "finalize_backward"):
        _return_tree_to_idle(context, discard_grads=False)
        deferred, context.handles_with_deferred_grad_hooks = context.handles_with_deferred_grad_hooks, []
        for handle in deferred:  # [Note: user post-accumulate-grad hooks]
            _run_user_grad_hooks(handle)


def _synchronize_host_copies(context: RootContext) -> None:
    """With CPU offload, the host's one wait per step: gradient downloads into
    pinned memory are complete (the optimizer may read them) and no upload
    still reads the shards (the optimizer may write them). Called after the
    scheduler's ``wait_for_all``, which made the compute stream wait on the
    post-reduce fence of the downloads on the reduction lane. See
    [Note: CPU offload copies] in flat_param.py and "The host is a third
    party" in [Note: lane fences] (scheduler.py)."""
    if context.offloads_params:
        context.scheduler.synchronize_host()


def _reset_after_error(context: RootContext) -> None:
    """Bring every unit back to IDLE and sharded (after a misuse)."""
    _return_tree_to_idle(context, discard_grads=True)
    context.handles_with_deferred_grad_hooks = []


def _return_tree_to_idle(context: RootContext, *, discard_grads: bool) -> None:
    """Finish every lane's work, reshard every unit, reset the per-step
    counters, and (with CPU offload) wait for the host's copies: the end of
    a backward, or, with ``discard_grads``, the reset after a misuse, which
    also drops unreduced gradients and re-registers every handle's
    parameters whatever it shows."""
    context.scheduler.wait_for_all()
    for unit in context.units:
        for handle in unit.handles:
            if discard_grads:
                handle.clear_unsharded_grad()
                _reshard_handle(context.scheduler, handle)
            elif handle.is_unsharded or handle.shows_unsharded_views:  # else post-backward resharded it
                _reshard_handle(context.scheduler, handle)
        unit.training_state = TrainingState.IDLE
        unit.reduced_handles.clear()
        unit.pending_backward_uses = 0
    context.post_backward_callback_queued = False
    _synchronize_host_copies(context)


def call_as_forward(state: UnitState, method: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``method`` (a unit's method other than ``forward``, registered
    with ``register_forward_method``) between the unit's forward hooks, as
    ``module(...)`` runs ``forward``; called from the unit's own forward it
    is a plain call (the parameters are already unsharded)."""
    if state.training_state is TrainingState.FORWARD:
        return method(module, *args, **kwargs)
    args, kwargs = _pre_forward(state, module, args, kwargs)
    output = method(module, *args, **kwargs)
    return _post_forward(state, module, args, output)


# ------------------------------------------------------------ optimizer step
def _register_optimizer_step_pre_hook_once() -> None:
    global _OPTIMIZER_STEP_PRE_HOOK
    if _OPTIMIZER_STEP_PRE_HOOK is None:
        _OPTIMIZER_STEP_PRE_HOOK = register_optimizer_step_pre_hook(_pre_optimizer_step)


def _pre_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before any ``Optimizer.step``: the trees whose parameters it updates
    end their held state (the step writes the shards; with CPU offload, an
    upload may still read them). See [Note: held for backward]."""
    for context in list(_ROOT_CONTEXTS):
        if context.root.root_context is not context:
            continue  # a tree that became part of a larger one
        held = any(unit.training_state is TrainingState.HELD_FOR_BACKWARD for unit in context.units)
        if held and _updates_tree(optimizer, context):
            reshard_held_units(context.units)


def _updates_tree(optimizer: torch.optim.Optimizer, context: RootContext) -> bool:
    params = {id(param) for unit in context.units for handle in unit.handles for param in handle.orig_params}
    return any(id(param) in params for group in optimizer.param_groups for param in group["params"])


# -------------------------------------------------------------- registration
def register_hooks(state: UnitState) -> None:
    """Attach the unit's forward hooks and its flat parameters'
    post-accumulate-grad hooks; every handle is kept in the state."""
    module = state.module
    state.module_hooks.append(
        module.register_forward_pre_hook(functools.partial(_pre_forward, state), with_kwargs=True)
    )
    state.module_hooks.append(module.register_forward_hook(functools.partial(_post_forward, state)))
    for handle in state.handles:  # also frozen ones: they may be unfrozen later
        # Weak: see [Note: hooks on tensors hold the unit weakly].
        hook: Callable[[torch.Tensor], None] = functools.partial(
            _post_backward_of, weakref.ref(state), weakref.ref(handle)
        )
        registered = handle.register_post_accumulate_grad_hook(hook)
        if registered is not None:
            state.module_hooks.append(registered)


# [Note: hooks on tensors hold the unit weakly]
# A hook registered on a tensor lives in autograd's C++ structures, which the
# garbage collector cannot see into. The post-accumulate-grad hook sits on the
# handle's own unsharded flat parameter, so a hook holding the state and the
# handle closes a cycle (state -> handle -> tensor -> hook -> state) that no
# collection ever frees: the model, its memory and its process groups lived
# until the interpreter exited, past ``dist.destroy_process_group`` (whose
# gloo and TCPStore threads then still ran at exit). The hook holds both
# weakly; the module's own forward hooks and ``module.__dict__`` (see
# [Note: the module owns its state]) keep them alive while the model is.
def _post_backward_of(
    state_ref: weakref.ReferenceType[UnitState],
    handle_ref: weakref.ReferenceType[FlatParamHandle],
    flat_param: torch.Tensor,
) -> None:
    state, handle = state_ref(), handle_ref()
    if state is not None and handle is not None:
        _post_backward(state, handle, flat_param)
