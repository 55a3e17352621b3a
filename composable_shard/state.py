"""Owns: the per-unit state, the context shared by one root's tree of units,
and where a module keeps its state (see [Note: the module owns its state]).

Knows nothing of: collectives, streams, flattening details.

Public names: ``TrainingState``, ``BETWEEN_STEPS``, ``UnitConfig``,
``UnitState``, ``RootContext``, ``get_state``, ``register_state``, ``unit_states_under``.
"""

from __future__ import annotations

import enum
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from .comm import ShardGroups
from .handle import FlatParamHandle
from .host_memory import HostMemoryTrimmer, trimming_enabled

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = [
    "TrainingState",
    "BETWEEN_STEPS",
    "UnitConfig",
    "UnitState",
    "RootContext",
    "get_state",
    "register_state",
    "unit_states_under",
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
    # backward, or in ``runtime.reshard_held_units`` before anything else
    # reads or changes the parameters (see [Note: held for backward]).
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


class UnitState:
    """State of one unit: its flat parameters, configuration and hooks."""

    def __init__(
        self,
        module: nn.Module,
        handles: list[FlatParamHandle],
        groups: ShardGroups,
        config: UnitConfig,
        compute_device: torch.device,
    ) -> None:
        # The user's module this state belongs to (no wrapper).
        self.module = module
        # One flat parameter per (dtype, requires_grad) group of the unit, as
        # fully_shard found them (requires_grad and dtype may change later:
        # [Note: changes to original parameters] in flat_param.py).
        self.handles = handles
        self.groups = groups
        self.config = config
        self.compute_device = compute_device
        # Name of the module under its root, known after lazy init.
        self.fqn: str = type(module).__name__
        self.training_state = TrainingState.IDLE
        # The shared context of the root's tree; None until lazy init.
        self.root_context: RootContext | None = None
        # Hooks on the module (kept so they can be removed).
        self.module_hooks: list[RemovableHandle] = []
        # Forward runs whose backward has not reached this unit's inputs yet
        # (frozen flat parameters reshard when it drops to 0).
        self.pending_backward_uses = 0
        # Trainable handles whose gradient was reduced in this backward.
        self.reduced_handles: set[int] = set()
        # Inside no_sync: gradients stay unsharded and accumulate locally.
        self.skip_grad_sync = False
        # Original dtype of each buffer cast to the mixed-precision
        # buffer_dtype, by name relative to the unit's module (full state
        # dicts give buffers back in these dtypes).
        self.orig_buffer_dtypes: dict[str, torch.dtype] = {}

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
        backward ([Note: resharding frozen flat parameters] in runtime.py)."""
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
        # Whether the end-of-backward callback is queued for this backward.
        self.post_backward_callback_queued = False
        # Nesting depth of unshard_params contexts over this tree.
        self.unshard_params_depth = 0
        # Whether any unit keeps its shards on CPU (offload): the host then
        # waits for the device once per step (computed once, read per step).
        self.offloads_params = any(handle.offload_params for unit in units for handle in unit.handles)
        # Handles whose reduction finished in this backward and whose
        # parameters have user post-accumulate-grad hooks to run at its end
        # (CPU offload only: see [Note: user post-accumulate-grad hooks] in
        # runtime.py).
        self.handles_with_deferred_grad_hooks: list[FlatParamHandle] = []
        # CPU trees give the heap's free pages back during backward (None:
        # CUDA, or switched off): [Note: trimming the host heap in backward].
        self.host_memory_trimmer = (
            HostMemoryTrimmer() if scheduler.device.type == "cpu" and trimming_enabled() else None
        )

    def next_in(self, order: list[UnitState], unit: UnitState, step: int) -> UnitState | None:
        """The unit ``step`` places after ``unit`` in ``order`` (None if out)."""
        try:
            index = order.index(unit) + step
        except ValueError:
            return None
        return order[index] if 0 <= index < len(order) else None


def raise_internal(unit: UnitState, message: str) -> None:
    """Report a broken internal invariant (a bug of ours, never user error)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = f"composable_shard internal error in unit '{unit.fqn}' on rank {rank} ({unit.training_state.name}): {message}"
    logger.error(text)
    raise AssertionError(text)


# [Note: the module owns its state]
# A unit's state lives in its module's ``__dict__`` (not an ``nn.Module``
# attribute: no child, no state-dict entry). A module-keyed
# ``WeakKeyDictionary`` cannot hold it: its values are strong references, and
# every state refers back to its module (``state.module``, the handles'
# parameter owners), so no sharded model was ever freed, and its process
# groups outlived ``dist.destroy_process_group``: their gloo threads and the
# TCPStore's thread were still running when the interpreter exited, where
# they aborted the process now and then. Module <-> state is an ordinary
# reference cycle that the garbage collector frees with the model.
_STATE_ATTRIBUTE = "_composable_shard_state"


def get_state(module: nn.Module) -> UnitState | None:
    return module.__dict__.get(_STATE_ATTRIBUTE)


def register_state(module: nn.Module, state: UnitState) -> None:
    module.__dict__[_STATE_ATTRIBUTE] = state


def unit_states_under(module: nn.Module) -> Iterator[tuple[str, UnitState]]:
    """Every unit state in ``module``'s tree with its name, pre-order."""
    for name, submodule in module.named_modules(remove_duplicate=True):
        state = get_state(submodule)
        if state is not None:
            yield name, state
