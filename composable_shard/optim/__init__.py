"""Owns: optimizers over the parameters of units — those that are not
elementwise step each whole parameter once per shard group on its owner
rank, torch's elementwise ones step runs of parameters as one tensor — and
``full_shape``, a parameter's original shape whatever it shows now.

Knows nothing of: hooks, files, the optimizers' update rules.

Layout (each module depends only on those above it)::

    owners.py      which rank owns each parameter, balanced by work
    owner_step.py  the exchange around the optimizer's own step
    flat_runs.py   which parameters of a layout are stepped as one tensor
    flat_step.py   the flat step around the optimizer's own step
    shapes.py      ``full_shape``

The runtime calls ``owner_step`` and ``flat_step`` around every optimizer
step through ``runtime.lifecycle.register_optimizer_step_extension``; which
optimizers are elementwise (and which are refused) is
``runtime/optimizer_checks.py``'s.
"""

from .flat_step import set_flat_step
from .owner_step import StepTraffic, last_step_traffic, owner_plans
from .shapes import full_shape

__all__ = ["full_shape", "owner_plans", "last_step_traffic", "StepTraffic", "set_flat_step"]
