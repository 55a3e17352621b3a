"""Owns: telling a backward that accumulates the tree's gradients
(``loss.backward()``) from one that only computes other gradients
(``torch.autograd.grad`` over inputs, ``backward(inputs=...)`` without the
flat parameters), and ending the latter with the units it gathered held
for a backward that may follow.

Knows nothing of: reductions, streams, the hooks that call it.

Public names: ``backward_accumulates``, ``hold_after_partial_backward``,
``note_accumulating_backward``, ``warn_step_after_partial_backwards``.

[Note: backwards that accumulate nothing of ours]
A gradient penalty runs ``autograd.grad(out, x, create_graph=True)`` and
then ``(loss + penalty).backward()``: the inner backward reaches the units'
outputs (their pre-backward gathers them) but never their flat
parameters' gradient accumulators, so no reduction can run in it; and the
outer backward needs the same gathered buffers again, through the graph the
inner one built. Ending the step at the inner backward's end (resharding
every unit) freed storage the outer backward's saved views alias. So a
backward in which the engine will execute no flat parameter's accumulator
(``torch._C._will_engine_execute_node``, asked once per backward) does not
end the step: at its end the units it gathered become ``HELD_FOR_BACKWARD``
([Note: held for backward] in lifecycle.py), which the outer backward picks
up and any other entry (a forward, the optimizer step) ends. Pinned by
tests/training/test_gradient_penalty.py.

[Note: a step after backwards that accumulated nothing]
``torch.distributed.pipelining``'s split backward (``stage_backward_input``,
then ``stage_backward_weight`` over the module's parameters: the
zero-bubble schedules) computes the weights' gradients with
``autograd.grad`` towards the original parameters, which the units' forward
never used (it uses views of the flat parameter): they stay None and the
step does nothing, silently. That is not supported (a stage given a
``dw_builder`` whose weight pass does nothing runs whole backwards
instead, and trains: docs/parallelism.md); it is told from a
gradient penalty (whose outer backward accumulates) by an optimizer step
over the tree while only backwards that accumulated nothing of ours ran
since the last step: it warns, naming the tree, once per tree. Pinned by
tests/training/test_pipeline.py.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable, cast

import torch
from torch.autograd import Variable
from torch.autograd.graph import Node

from ..handle import FlatParamHandle
from .state import RootContext, TrainingState, UnitState
from .labels import hook_label

__all__ = [
    "backward_accumulates",
    "hold_after_partial_backward",
    "note_accumulating_backward",
    "warn_step_after_partial_backwards",
]

# Per tree, the backward (graph task id) last classified and the answer.
_CLASSIFIED: weakref.WeakKeyDictionary[RootContext, tuple[int, bool]] = weakref.WeakKeyDictionary()
# Per tree, the backward whose end already has the hold queued.
_HOLD_QUEUED: weakref.WeakKeyDictionary[RootContext, int] = weakref.WeakKeyDictionary()
# Trees where only backwards that accumulated nothing ran since the last
# accumulating backward or optimizer step ([Note: a step after backwards
# that accumulated nothing]), and those already warned about.
_PARTIAL_ONLY: weakref.WeakSet[RootContext] = weakref.WeakSet()
_WARNED: weakref.WeakSet[RootContext] = weakref.WeakSet()


def backward_accumulates(unit: UnitState) -> bool:
    """Whether the running backward accumulates gradients into the flat
    parameters of ``unit``'s tree (see the module note). A tree with no
    trainable flat parameter counts as accumulating (the step ends as ever)."""
    context = unit.context
    task = torch._C._current_graph_task_id()
    known = _CLASSIFIED.get(context)
    if known is not None and known[0] == task:
        return known[1]
    # This unit's own handles first: in a plain backward the answer is then
    # one lookup.
    handles = [h for h in unit.handles if h.unsharded_flat_param.requires_grad]
    handles += [h for other in context.units if other is not unit for h in other.handles if h.unsharded_flat_param.requires_grad]
    accumulates = not handles or any(_accumulator_runs(handle) for handle in handles)
    _CLASSIFIED[context] = (task, accumulates)
    return accumulates


def _accumulator_runs(handle: FlatParamHandle) -> bool:
    flat_param = handle.unsharded_flat_param
    with torch.enable_grad():
        # It requires grad (the callers' filter): its view's grad_fn exists and leads to its AccumulateGrad.
        grad_fn = cast(Node, flat_param.view_as(flat_param).grad_fn)
        accumulator = cast(Node, grad_fn.next_functions[0][0])
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:
        # autograd.grad with the flat parameter itself as an input: only our
        # own code could pass it; count it as accumulating.
        return True


def hold_after_partial_backward(context: RootContext) -> None:
    """Queue, once per backward, the end of a backward that accumulates
    nothing of ours: the units it gathered are held for the next one."""
    task = torch._C._current_graph_task_id()
    if _HOLD_QUEUED.get(context) == task:
        return
    _HOLD_QUEUED[context] = task
    _PARTIAL_ONLY.add(context)
    # Weak: a callback lives in the engine, out of the collector's sight
    # ([Note: hooks on tensors hold the unit weakly] in hooks.py).
    Variable._execution_engine.queue_callback(functools.partial(_hold_units, weakref.ref(context)))
    context.scheduler.mark_shards_written()  # a backward starts: [Note: what a lane waits for]


def _hold_units(context_ref: weakref.ReferenceType[RootContext]) -> None:
    context = context_ref()
    if context is None:
        return
    with hook_label(context.root, "end_partial_backward"):
        for unit in context.units:
            if unit.training_state is TrainingState.PRE_BACKWARD:
                unit.transition(TrainingState.HELD_FOR_BACKWARD, TrainingState.PRE_BACKWARD)
                for handle in unit.handles:
                    handle.hide_unsharded_views()


def note_accumulating_backward(context: RootContext) -> None:
    """A backward that accumulates the tree's gradients ended."""
    _PARTIAL_ONLY.discard(context)


def warn_step_after_partial_backwards(context: RootContext, updates_tree: Callable[[], bool]) -> None:
    """An optimizer step (over the tree where ``updates_tree()``): warn
    (once per tree) if only backwards that accumulated nothing of ours ran
    since the last step or accumulating backward ([Note: a step after
    backwards that accumulated nothing])."""
    if context in _PARTIAL_ONLY and updates_tree():
        _PARTIAL_ONLY.discard(context)
        if context not in _WARNED:
            _WARNED.add(context)
            warnings.warn(
                f"fully_shard({type(context.root.module).__name__}): optimizer.step() after backwards that computed no gradient of "
                "its flat parameters (torch.autograd.grad or backward(inputs=...) without them, or "
                "torch.distributed.pipelining's split backward, stage_backward_input / stage_backward_weight, "
                "which composable_shard does not support: its weight gradients stay None). The parameters' .grad "
                "are unchanged. Use loss.backward(); under a zero-bubble schedule give each PipelineStage "
                "dw_builder=lambda: (lambda: None) so that it runs whole backwards (or use GPipe or 1F1B).",
                stacklevel=3,
            )
