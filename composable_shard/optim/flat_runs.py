"""Owns: which parameters of a layout the flat step steps as one tensor
(``flat_runs``), and its switch (``flat_step_enabled``) — for the runtime's
step (optim/flat_step.py) and the plan (planning/memory.py) alike.

Knows nothing of: optimizers, hooks, gradients.

Public names: ``FLAT_STEP_ENV``, ``flat_step_enabled``, ``flat_runs``.
"""

from __future__ import annotations

import os
from typing import Sequence

from ..handle.layout import ParamInfo

__all__ = ["FLAT_STEP_ENV", "flat_step_enabled", "flat_runs"]

# "0" switches the flat step off ([Note: the flat step] in optim/flat_step.py).
FLAT_STEP_ENV = "COMPOSABLE_SHARD_FLAT_STEP"


def flat_step_enabled() -> bool:
    return os.environ.get(FLAT_STEP_ENV, "1") != "0"


def flat_runs(params: Sequence[ParamInfo]) -> list[list[int]]:
    """The parameters of one layout that lie back to back in this rank's
    shard, as runs of consecutive indices: stepped in layout order, each run
    is one tensor of the flat step. A parameter this rank holds nothing of
    joins the run it falls in; a run of one is a parameter stepped alone."""
    runs: list[list[int]] = []
    current: list[int] = []
    end: int | None = None
    for index, info in enumerate(params):
        if info.local_numel and end is not None and info.shard_offset != end:
            runs.append(current)
            current = []
        current.append(index)
        if info.local_numel:
            end = info.shard_offset + info.local_numel
    if current:
        runs.append(current)
    # A run needs an element to step: one of empty parameters is none.
    return [run for whole in runs for run in ([whole] if any(params[i].local_numel for i in whole) else [[i] for i in whole])]
