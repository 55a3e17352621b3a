"""Owns: memory planning before a run — which units ``fully_shard`` would
build, how each flat parameter is laid out and sharded, and what every rank
holds at the worst moment of a training step.

- ``sharding_plan.py``: ``plan`` and ``describe`` (the public entry points)
  and ``ShardingPlan``;
- ``arguments.py``: their arguments checked before anything is computed;
- ``memory.py``: the per-rank memory arithmetic;
- ``step_replay.py``: the replay of one step and its worst moment;
- ``owner_memory.py``: optimizers stepped whole on owner ranks (Muon,
  Adafactor, a user's own): the runtime's owners on the plan's layouts, the
  owners' whole state, the step's exchange and temporaries;
- ``activations.py``: activation memory measured under fake tensors;
- ``table.py``: the printed table;
- ``advice.py``: the plan's warnings;
- ``unit_plans.py``: the per-unit descriptions the plan is assembled from;
- ``budget.py``: each unit's layout chosen for a memory budget
  (``plan(..., memory_budget=...)``, ``ShardingPlan.layout_policy()``);
- ``capacity.py``: ``largest_fitting``, the largest model size whose plan
  fits a memory budget;
- ``timeline.py``: the step's memory moment by moment (``plan.timeline()``);
- ``plot.py``: its picture (``plan.plot(path)``; matplotlib, optional);
- ``measured.py``: ``MemoryRecorder``, a real step's memory at every hook.

Knows nothing of: hooks, collectives, storage.

Public names: ``plan``, ``describe``, ``ShardingPlan``, ``largest_fitting``,
``Capacity``, ``MemoryRecorder``, ``MemoryTimeline``.
"""

from .capacity import Capacity, largest_fitting
from .measured import MemoryRecorder
from .sharding_plan import ShardingPlan, describe, plan
from .timeline import MemoryTimeline

__all__ = ["plan", "describe", "ShardingPlan", "largest_fitting", "Capacity", "MemoryRecorder", "MemoryTimeline"]
