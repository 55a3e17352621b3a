"""Owns: optimizers over the parameters of units that are not elementwise —
each whole parameter stepped once per shard group by its owner rank — and
``full_shape``, a parameter's original shape whatever it shows now.

Knows nothing of: hooks, files, the optimizers' update rules.

Layout (each module depends only on those above it)::

    owners.py      which rank owns each parameter, balanced by work
    owner_step.py  the exchange around the optimizer's own step
    shapes.py      ``full_shape``

The runtime calls ``owner_step`` around every optimizer step through
``runtime.lifecycle.register_optimizer_step_extension``; which optimizers are
elementwise (and which are refused) is ``runtime/optimizer_checks.py``'s.
"""

from .owner_step import StepTraffic, last_step_traffic, owner_plans
from .shapes import full_shape

__all__ = ["full_shape", "owner_plans", "last_step_traffic", "StepTraffic"]
