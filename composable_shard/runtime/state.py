"""Owns: the per-unit state and its mechanics — unshard, reshard and reduce
its flat parameters through the root's scheduler — the context shared by one
root's tree of units, and where a module keeps its state (see
[Note: the module owns its state]).

Knows nothing of: collectives, streams, flattening details (it calls the
handles and the scheduler), hooks and the step's lifecycle (runtime/).

Public names: ``TrainingState``, ``BETWEEN_STEPS``, ``UnitConfig``,
``UnitState``, ``RootContext``, ``raise_internal``, ``get_state``,
``register_state``, ``unit_states_under``, ``units_of``.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from ..comm import PendingCollective, ReductionOverrides, ShardGroups, check_overrides
from ..comm.tags import collective_of
from ..handle import FlatParamHandle, pending_views
from .gather_buckets import unshard_with_followers
from .grad_buckets import hold_for_bucket
from .host_memory import HostMemoryTrimmer, trimming_enabled

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = [
    "TrainingState",
    "BETWEEN_STEPS",
    "UnitConfig",
    "UnitState",
    "RootContext",
    "raise_internal",
    "get_state",
    "register_state",
    "unit_states_under",
    "units_of",
]

logger = logging.getLogger(__name__)


class TrainingState(enum.Enum):
    """Where a unit is in the step."""

    # Between steps, or between forward and backward: parameters sharded.
    IDLE = enum.auto()
    # Inside the unit's forward: parameters unsharded.
    FORWARD = enum.auto()
    # Forward ended with autograd on and the unit kept its parameters
    # gathered for a backward that may never come; the owners show the
    # shards meanwhile. Ends at the unit's pre-backward, at the end of
    # backward, or at the lifecycle's gate before anything else reads or
    # changes the parameters ([Note: held for backward] in
    # runtime/lifecycle.py).
    HELD_FOR_BACKWARD = enum.auto()
    # Backward reached the unit's outputs: parameters unsharded for gradient
    # computation (also during an activation-checkpoint re-run).
    PRE_BACKWARD = enum.auto()
    # Every trainable flat parameter's gradient was reduced this backward.
    POST_BACKWARD = enum.auto()


# The states of a unit while no forward or backward runs in its tree.
BETWEEN_STEPS = (TrainingState.IDLE, TrainingState.HELD_FOR_BACKWARD)


@dataclass(frozen=True)
class UnitConfig:
    """The ``fully_shard`` arguments that apply to one unit."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision | None
    offload_params: bool
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch | None
    limit_all_gathers: bool


# Numbers units in the order fully_shard builds them: the same on every rank,
# so work over all units (the owner step) runs in one order everywhere.
_BUILD_COUNTER = itertools.count()


class UnitState:
    """State of one unit: its flat parameters, configuration and hooks."""

    def __init__(
        self,
        module: nn.Module,
        handles: list[FlatParamHandle],
        groups: ShardGroups,
        config: UnitConfig,
        compute_device: torch.device,
        members: tuple[nn.Module, ...] | None = None,
    ) -> None:
        # The user's module this state belongs to (no wrapper); for a group
        # (``fully_shard([a, b])``) its first module.
        self.module = module
        # Every module of the unit: ``(module,)``, or a group's modules in
        # the order given (runtime/groups.py drives a group's hooks).
        self.members: tuple[nn.Module, ...] = members or (module,)
        # One flat parameter per (dtype, requires_grad) group of the unit, as
        # fully_shard found them (requires_grad and dtype may change later:
        # [Note: changes to original parameters] in handle/writeback.py).
        self.handles = handles
        self.groups = groups
        self.config = config
        self.compute_device = compute_device
        # Position in the order fully_shard built the process's units.
        self.build_index: int = next(_BUILD_COUNTER)
        # As a root: the size of its tree's buckets of small units'
        # all-gathers and reductions (None: comm's defaults; 0: none), as a
        # budgeted layout chose it ([Note: a layout chosen for a memory
        # budget] in planning/budget.py).
        self.bucket_bytes: int | None = None
        # Name of the module under its root, known after lazy init.
        self.fqn: str = type(module).__name__
        self.training_state = TrainingState.IDLE
        # The shared context of the root's tree; None until lazy init.
        self.root_context: RootContext | None = None
        # Hooks on the module (kept so they can be removed).
        self.module_hooks: list[RemovableHandle] = []
        # Calls of a registered forward method in progress: the module's own
        # forward inside one is part of it ([Note: forward methods] in
        # runtime/hooks.py).
        self.forward_method_depth = 0
        # Forward runs whose backward has not reached this unit's inputs yet
        # (frozen flat parameters reshard when it drops to 0).
        self.pending_backward_uses = 0
        # Trainable handles whose gradient was reduced in this backward.
        self.reduced_handles: set[FlatParamHandle] = set()
        # The backward (graph task id) whose pre-backward gathered the unit,
        # and the handles held for its end ([Note: reentrant checkpoints
        # inside a unit] in runtime/nested_backwards.py).
        self.backward_task = -1
        self.nested_deferred: list[FlatParamHandle] = []
        # Inside no_sync: gradients stay unsharded and accumulate locally.
        self.skip_grad_sync = False
        # Per-unit runtime controls (controls/per_unit.py; checked by
        # runtime/unit_controls.py at the unit's next forward or backward).
        # None: the strategy's rule (the root and the last unit stay gathered).
        self.reshard_after_forward: bool | None = None
        self.reshard_after_backward = True
        # Whether the end of the tree's next backward finishes its reductions.
        self.is_last_backward = True
        # Units whose all-gathers this unit's forward / backward issues
        # (None: the prefetch options decide).
        self.forward_prefetch_units: list[UnitState] | None = None
        self.backward_prefetch_units: list[UnitState] | None = None
        # Original dtype of each buffer cast to the mixed-precision
        # buffer_dtype, per module of the unit (by id; a group has several)
        # and by name relative to it: full state dicts give buffers back in
        # these dtypes. Read with buffer_dtypes_of.
        self.orig_buffer_dtypes: dict[int, dict[str, torch.dtype]] = {}
        # The parameters its fully_shard call left out (ignored_states, and
        # those of ignored modules), which stay out of the units above it
        # (units/rules.py: ``split_ignored``), as in FSDP1.
        self.ignored_params: frozenset[nn.Parameter] = frozenset()
        # The user's overrides of the gradient reduction (divide factor,
        # replica all-reduce, hooks: composable_shard/reduce_controls.py),
        # shared with the unit's handles.
        self.reduction_overrides = ReductionOverrides()
        for handle in handles:
            handle.reduction_overrides = self.reduction_overrides

    def buffer_dtypes_of(self, module: nn.Module) -> dict[str, torch.dtype]:
        """The original dtypes of ``module``'s buffers that mixed precision
        cast, by name relative to ``module`` (one of this unit's modules)."""
        return self.orig_buffer_dtypes.get(id(module), {})

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1

    @property
    def is_root(self) -> bool:
        return self.root_context is not None and self.root_context.root is self

    @property
    def trainable_handles(self) -> list[FlatParamHandle]:
        """The handles with gradients. Derived each time (a few handles), so
        it follows ``requires_grad`` changes without a copy to keep current."""
        return [handle for handle in self.handles if handle.requires_grad]

    @property
    def frozen_handles_to_reshard(self) -> list[FlatParamHandle]:
        """Handles holding frozen parameters, with storage to free after
        backward ([Note: resharding frozen flat parameters] in
        runtime/forward_inputs.py)."""
        return [handle for handle in self.handles if handle.has_frozen_params and handle.needs_unshard_storage]

    @property
    def name_prefix(self) -> str:
        """The unit's name and a dot, to complete its parameters' names in
        messages (empty for the root and before lazy init)."""
        return "" if self.root_context is None or self.is_root else f"{self.fqn}."

    @property
    def is_unsharded(self) -> bool:
        return any(handle.is_unsharded and handle.needs_unshard_storage for handle in self.handles)

    def transition(self, new_state: TrainingState, *allowed_from: TrainingState) -> None:
        """Move to ``new_state``; being elsewhere than ``allowed_from`` is a
        bug of ours, reported with unit, rank and state."""
        if self.training_state not in allowed_from:
            raise_internal(
                self,
                f"cannot move to {new_state.name} from {self.training_state.name} "
                f"(allowed from {[s.name for s in allowed_from]})",
            )
        self.training_state = new_state

    def __repr__(self) -> str:
        return f"UnitState({self.fqn}, {self.training_state.name}, {len(self.handles)} flat params)"

    def __reduce_ex__(self, protocol: object) -> Any:
        # copy.deepcopy and pickle (torch.save of a module) both come here:
        # a unit's shards, process groups and hooks belong to this run.
        raise TypeError(
            f"composable_shard: a sharded module cannot be deep-copied or pickled (unit '{self.fqn}', "
            f"{type(self.module).__name__}): its shards and process groups belong to this run. Copy the model "
            "before fully_shard; to save it, use get_model_state_dict or save_checkpoint."
        )

    # ------------------------------------------------------------ mechanics
    @property
    def context(self) -> RootContext:
        """The root's shared context; lazy init must have run."""
        if self.root_context is None:
            raise_internal(self, "used before lazy init")
        return self.root_context  # type: ignore[return-value]  # raise_internal never returns

    def unshard(
        self, *, wait: bool, followers: Iterable[list[FlatParamHandle]] | None = None, reuse_views: bool = False
    ) -> None:
        """Issue the unit's all-gathers (no-op where already issued or
        unsharded), with the ``followers``' (the next units' flat parameters
        in the phase's order) where they may share one collective
        ([Note: coalesced all-gathers] in runtime/gather_buckets.py); with
        ``wait``, make compute wait and point the owners at unsharded views
        (with ``reuse_views``, the pre-backward's: the forward's views where
        they are still valid, [Note: forward views reused in backward] in
        handle/forward_views.py)."""
        scheduler = self.context.scheduler
        if followers is not None:
            unshard_with_followers(scheduler, self.handles, followers)
        for handle in self.handles:
            if not handle.needs_unshard_storage:
                # Its own shard (NO_SHARD in its dtype): gathers and copies
                # nothing, but its issue is still fenced ([Note: lane
                # fences]); it launches nothing, without a tag.
                scheduler.unshard(handle, _launch_nothing)
            elif not handle.is_unsharded or scheduler.has_pending_unshard(handle):
                scheduler.unshard(handle, functools.partial(_launch_unshard, handle))
            else:  # gathered, and compute already waited for it
                scheduler.use_gathered()
        if wait:
            for handle in self.handles:
                scheduler.wait_for_unshard(handle)
                if reuse_views and handle.reuse_forward_views():
                    continue
                # Views must be autograd views of the flat parameter even when
                # built from a backward hook, where grad mode is off.
                with torch.enable_grad():
                    handle.use_unsharded_views()

    def prefetch(self, followers: Iterable[list[FlatParamHandle]] | None = None) -> None:
        """Issue the unit's all-gathers without waiting (a prefetch)."""
        if self.handles:
            self.unshard(wait=False, followers=followers)

    def hold_for_backward(self) -> None:
        """End the forward keeping the unsharded buffers for the backward
        that should come, while the owners show the shards ([Note: held for
        backward] in runtime/lifecycle.py)."""
        self.transition(TrainingState.HELD_FOR_BACKWARD, TrainingState.FORWARD)
        for handle in self.handles:
            handle.hide_unsharded_views()

    def reshard(self, *, defer_free: bool = False) -> None:
        """Show the shards again and free every unsharded buffer of the unit
        (``defer_free``: as ``Scheduler.free_unsharded``'s ``defer``)."""
        for handle in self.handles:
            self.reshard_handle(handle, defer_free=defer_free)

    def reshard_handle(self, handle: FlatParamHandle, *, defer_free: bool = False) -> None:
        """Show the handle's shard again; the scheduler frees its unsharded
        buffer after marking compute's last use of it ([Note: what a lane
        waits for] in runtime/scheduler.py): every free of a buffer a lane allocated
        goes through here."""
        scheduler = self.context.scheduler
        scheduler.wait_for_unshard(handle)
        handle.reshard(free_storage=False)
        if handle.unsharded_storage_bytes():
            scheduler.free_unsharded(handle, handle.free_unsharded_storage, defer=defer_free)

    def reduce_grad(self, handle: FlatParamHandle) -> bool:
        """The handle's gradient is accumulated: issue its reduction (none
        inside ``no_sync``), reshard it (a handle with frozen parameters
        waits: [Note: resharding frozen flat parameters]) and count it.
        Returns whether every trainable handle of the unit is now reduced."""
        context = self.context
        # Its pre-backward took them in, unless its outputs had no hook:
        # [Note: zero_grad while no_sync gradients wait] in handle/pending_views.py.
        pending_views.take_user_changes(handle, name_prefix=self.name_prefix, accumulated=True)
        if not self.skip_grad_sync:
            # [Note: parameters a backward leaves without a gradient] in handle/grad_usage.py
            handle.grad_usage.check_reduced(handle.layout.params, handle.param_requires_grad, self.fqn)
            settings = handle.reduction_settings()
            # Refuses what a communication hook cannot honour ([Note: communication hooks]).
            check_overrides(settings, handle.param_dtype, f"'{self.fqn}' ({type(self.module).__name__})")
            try:
                # [Note: coalesced reductions] in runtime/grad_buckets.py
                if not hold_for_bucket(context.scheduler, handle, settings, functools.partial(_finish_reduction, context)):
                    context.scheduler.reduce(
                        functools.partial(_launch_reduce, handle),
                        functools.partial(_finish_reduction, context, handle),
                        finish_on_lane=handle.offload_params,  # downloads off compute: [Note: lane fences]
                    )
            except Exception as error:  # a communication hook's own error: [Note: communication hooks]
                # __notes__ as add_note keeps it (Python 3.11+ prints it; 3.10 lacks add_note).
                note = f"composable_shard: raised while unit '{self.fqn}' issued its gradient reduction"
                error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]  # 3.11+ in typeshed
                raise
        if not handle.has_frozen_params and self.reshard_after_backward:
            self.reshard_handle(handle)
        self.reduced_handles.add(handle)
        return len(self.reduced_handles) == len(self.trainable_handles)

    def reshard_frozen_when_done(self) -> None:
        """Reshard the frozen flat parameters once backward is done with them
        ([Note: resharding frozen flat parameters])."""
        if (
            self.reshard_after_backward
            and self.pending_backward_uses == 0
            and len(self.reduced_handles) == len(self.trainable_handles)
        ):
            for handle in self.frozen_handles_to_reshard:
                self.reshard_handle(handle)

    def reset_step_counters(self) -> None:
        """Back to IDLE with nothing counted for a backward."""
        self.training_state = TrainingState.IDLE
        self.reduced_handles.clear()
        self.pending_backward_uses = 0
        self.nested_deferred.clear()


class RootContext:
    """What one root shares with every unit of its tree, built once by the
    root's lazy init."""

    def __init__(self, root: UnitState, units: list[UnitState], scheduler: Scheduler) -> None:
        self.root = root
        # Every unit of the tree in module pre-order (root first).
        self.units = units
        self.scheduler = scheduler
        # Units in the order their forward started this iteration.
        self.forward_order: list[UnitState] = []
        # The previous iteration's forward order (forward prefetch uses it).
        self.previous_forward_order: list[UnitState] = []
        # The order the first forward is expected in, before any ran: the
        # tree's module pre-order without the units some ranks skip (set by
        # lazy init; [Note: coalesced all-gathers] in runtime/gather_buckets.py).
        self.first_forward_order: list[UnitState] = []
        # Whether some unit lists the all-gathers it prefetches (read at
        # each root forward): then none is coalesced.
        self.user_orders_all_gathers = False
        # Root forwards counted; the latest whose outputs were hooked for
        # backward, and the latest whose backward started (pre-backward
        # hooks carry their forward's number): [Note: optimizer step
        # between forward and backward] in runtime/optimizer_checks.py.
        self.forward_serial = 0
        self.hooked_forward = 0
        self.backward_started_forward = 0
        # Whether the end-of-backward callback is queued for this backward.
        self.post_backward_callback_queued = False
        # Whether any unit keeps its shards on CPU (offload): the host then
        # waits for the device once per step (computed once, read per step).
        self.offloads_params = any(handle.offload_params for unit in units for handle in unit.handles)
        # Handles whose reduction finished in this backward and whose
        # parameters have user post-accumulate-grad hooks to run at its end
        # (CPU offload only: see [Note: user post-accumulate-grad hooks]).
        self.handles_with_deferred_grad_hooks: list[FlatParamHandle] = []
        # CPU trees give the heap's free pages back during backward (None:
        # CUDA, or switched off): [Note: trimming the host heap in backward].
        self.host_memory_trimmer = (
            HostMemoryTrimmer() if scheduler.device.type == "cpu" and trimming_enabled() else None
        )

    def start_forward_order(self) -> None:
        """A new forward of the root: keep the last one's order for forward
        prefetch and record this one's."""
        if self.forward_order:
            self.previous_forward_order = self.forward_order
        self.forward_order = []
        self.forward_serial += 1
        # [Note: coalesced all-gathers] in runtime/gather_buckets.py
        self.user_orders_all_gathers = any(
            unit.forward_prefetch_units is not None or unit.backward_prefetch_units is not None for unit in self.units
        )

    def record_forward(self, unit: UnitState) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def next_in(self, order: list[UnitState], unit: UnitState, step: int) -> UnitState | None:
        """The unit ``step`` places after ``unit`` in ``order`` (None if out)."""
        try:
            index = order.index(unit) + step
        except ValueError:
            return None
        return order[index] if 0 <= index < len(order) else None

    @functools.cached_property
    def param_ids(self) -> frozenset[int]:
        """The ids of every original parameter of the tree's units, to tell
        by identity whether an optimizer updates the tree (asked before
        every ``optimizer.step``). Built once: the units, their handles and
        the handles' parameters are fixed by lazy init, and the handles hold
        the parameters, so no id can be reused while the context lives."""
        return frozenset(id(param) for unit in self.units for handle in unit.handles for param in handle.orig_params)

    def run_deferred_grad_hooks(self) -> None:
        """End of backward with CPU offload: the gradients reached host
        memory, so the user hooks deferred until now run."""
        deferred, self.handles_with_deferred_grad_hooks = self.handles_with_deferred_grad_hooks, []
        for handle in deferred:  # [Note: user post-accumulate-grad hooks]
            run_user_grad_hooks(handle)


def _launch_unshard(handle: FlatParamHandle, async_op: bool) -> PendingCollective | None:
    with collective_of(handle):  # [Note: tagged collectives] in comm/tags.py
        return handle.unshard(async_op=async_op)


def _launch_nothing(async_op: bool) -> None:
    """The unshard of a flat parameter that is its own shard: always
    unsharded, so ``FlatParamHandle.unshard`` would return None at once."""
    return None


def _launch_reduce(handle: FlatParamHandle, async_op: bool) -> PendingCollective | None:
    with collective_of(handle):
        return handle.reduce_grad(async_op=async_op)


def _finish_reduction(context: RootContext, handle: FlatParamHandle, reduced: PendingCollective) -> None:
    """The handle's sharded gradient is final: show it in ``.grad`` and run
    the user's post-accumulate-grad hooks.

    [Note: user post-accumulate-grad hooks]
    The original parameters never take part in autograd (forward and
    backward use views of the unsharded flat parameter), so hooks a user
    registers on them with ``register_post_accumulate_grad_hook`` run here
    instead: once per backward that reduces the handle (not inside
    ``no_sync``), after the reduction, with ``.grad`` holding this rank's
    part; parameters in reverse layout order. An optimizer stepping from its
    hook works, since nothing reads the shard again in this backward. With
    CPU offload the gradients reach host memory only at the end of
    backward, so the hooks run there. torch's
    ``torch.distributed.optim._apply_optimizer_in_backward`` tags each
    parameter with its optimizers (``_in_backward_optimizers``) and hooks
    the parameter's gradient accumulator, which never runs here: the tagged
    optimizers step at the same place, and ``.grad`` is cleared after, as
    its hook does (FSDP1 steps them in its post-backward too; before, the
    parameters silently never moved). Pinned by
    tests/runtime/test_optimizer_in_backward.py.
    """
    if handle.finish_grad_reduction(reduced) is False:
        return  # a partial sum kept for a later all-reduce: no gradient yet
    if any(
        param._post_accumulate_grad_hooks or getattr(param, _IN_BACKWARD_OPTIMIZERS, None)
        for param in handle.orig_params
    ):
        if context.offloads_params:
            context.handles_with_deferred_grad_hooks.append(handle)
        else:
            run_user_grad_hooks(handle)
            context.scheduler.mark_shards_written()  # an optimizer in backward: [Note: what a lane waits for]


# The attribute torch's _apply_optimizer_in_backward tags parameters with.
_IN_BACKWARD_OPTIMIZERS = "_in_backward_optimizers"


def run_user_grad_hooks(handle: FlatParamHandle) -> None:
    """See [Note: user post-accumulate-grad hooks]."""
    for param, requires_grad in zip(reversed(handle.orig_params), reversed(handle.param_requires_grad)):
        if not (requires_grad and param.requires_grad):
            continue  # a frozen parameter gets no gradient, no hook
        hooks = param._post_accumulate_grad_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                hook(param)
        optimizers = getattr(param, _IN_BACKWARD_OPTIMIZERS, None)
        if optimizers:
            for optimizer in optimizers:
                optimizer.step()
            param.grad = None


def raise_internal(unit: UnitState, message: str) -> None:
    """Report a broken internal invariant (a bug of ours, never user error)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = f"composable_shard internal error in unit '{unit.fqn}' on rank {rank} ({unit.training_state.name}): {message}"
    logger.error(text)
    raise AssertionError(text)


# [Note: the module owns its state]
# A unit's state lives in its module's ``__dict__`` (not an ``nn.Module``
# attribute: no child, no state-dict entry). A module-keyed
# ``WeakKeyDictionary`` cannot hold it: its values are strong, and every
# state refers back to its module, so the model (and its process groups,
# past ``destroy_process_group``) would never be freed. Module <-> state is
# an ordinary cycle the garbage collector frees with the model. Pinned by
# tests/runtime/test_model_lifetime.py.
_STATE_ATTRIBUTE = "_composable_shard_state"


def get_state(module: nn.Module) -> UnitState | None:
    return module.__dict__.get(_STATE_ATTRIBUTE)


def register_state(module: nn.Module, state: UnitState) -> None:
    module.__dict__[_STATE_ATTRIBUTE] = state


def unit_states_under(module: nn.Module) -> Iterator[tuple[str, UnitState]]:
    """Every unit state in ``module``'s tree with its name, pre-order (by a
    unit's first module found). A group is yielded once, named by its
    modules found under ``module`` joined with "+" ("norm+output")."""
    names: dict[UnitState, list[str]] = {}
    for name, submodule in module.named_modules(remove_duplicate=True):
        state = get_state(submodule)
        if state is not None:
            names.setdefault(state, []).append(name)
    for state, member_names in names.items():
        yield "+".join(member_names), state


def units_of(module: nn.Module, *, recurse: bool, what: str) -> list[UnitState]:
    """``module``'s unit, or with ``recurse`` every unit in its tree; raises
    naming ``what`` and the module when there is none (the public functions
    that take a sharded module all check it this way)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected a module given to fully_shard, got {type(module).__name__}.")
    if recurse:
        units = [state for _, state in unit_states_under(module)]
    else:
        state = get_state(module)
        units = [state] if state is not None else []
    if not units:
        where = "in this tree was" if recurse else "itself was"
        raise ValueError(
            f"{what}({type(module).__name__}): no module {where} given to fully_shard. Call fully_shard(module) "
            "first, and call this on a module fully_shard made a unit."
        )
    return units
