"""Owns: the runtime's public face — what drives a training step over a
sharded tree, from the hooks to the lifecycle of the tree.

Knows nothing of: anything its modules do not (it only re-exports them).

Layout (each module depends only on those above it)::

    labels.py          the profiler range, debug line and error log of a hook
    optimizer_checks.py  what the optimizer step refuses: optimizers not
                       elementwise over shards, a step between a forward
                       and its backward
    prefetch.py        which unit to gather ahead, and when (explicit lists too)
    unit_controls.py   what the per-unit runtime controls change in a step:
                       units kept gathered between steps, backwards that
                       are not the last, combinations refused
    lifecycle.py       a tree idle / in a step / held for backward; the one
                       gate every entry from outside a step passes; back to
                       idle at the end of backward; the optimizer step hook
    root.py            lazy init: the root's shared context
    partial_backward.py  a backward that accumulates none of the tree's
                       gradients (autograd.grad over inputs) holds, not ends
    pending_grads.py   no_sync gradients of units absent from the
                       synchronised backward, reduced at its end
    compiled_autograd.py  a backward under compiled autograd, refused
    forward_inputs.py  device check, mixed-precision cast, the frozen
                       parameters' end-of-use report
    hooks.py           the hooks, each a few lines, and their registration
    groups.py          a group's forward hooks: one unit's forward over
                       several modules (``fully_shard([a, b])``)

A unit's own mechanics (unshard, reshard, reduce its flat parameters) are
``UnitState``'s methods (runtime/state.py); streams and events are the scheduler's.

Public names: ``register_hooks``, ``call_as_forward``, ``lazy_init``,
``in_backward``, ``enter_between_steps``, ``TreePhase``, ``tree_phase``,
``backward_prefetch_point``, ``mark_local_accumulation``.
"""

from .lifecycle import TreePhase, enter_between_steps, in_backward, tree_phase
from .root import lazy_init
from .prefetch import backward_prefetch_point
from .hooks import call_as_forward, register_hooks
from .pending_grads import mark_local_accumulation

__all__ = [
    "register_hooks",
    "call_as_forward",
    "lazy_init",
    "in_backward",
    "enter_between_steps",
    "TreePhase",
    "tree_phase",
    "backward_prefetch_point",
    "mark_local_accumulation",
]
