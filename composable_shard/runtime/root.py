"""Owns: lazy init — making a unit the root of its tree, with the context
(one scheduler, one forward-order record) every unit below it shares.

Knows nothing of: the hooks, flattening details.

Public names: ``lazy_init``.
"""

from __future__ import annotations

import logging

from .. import comm
from .scheduler import Scheduler
from .state import RootContext, UnitState, unit_states_under
from .lifecycle import track_root
from .skipped_units import is_marked, tag_collectives

__all__ = ["lazy_init"]

logger = logging.getLogger(__name__)


def lazy_init(state: UnitState) -> RootContext:
    """Make ``state`` the root of its tree (idempotent): one scheduler and
    one forward-order record shared by every unit below it; units of an
    earlier, smaller tree join this one."""
    if state.root_context is not None and state.root_context.root is state:
        return state.root_context
    named_units = list(unit_states_under(state.module))
    units = [unit for _, unit in named_units]
    # An earlier, smaller tree (an explicit unshard before the first
    # forward) may have work in flight on its scheduler: finished first.
    for earlier in {id(u.root_context): u.root_context for u in units if u.root_context is not None}.values():
        earlier.scheduler.wait_for_all()
    context = RootContext(
        state,
        units,
        Scheduler(
            state.compute_device,
            limit_all_gathers=state.config.limit_all_gathers,
            bucket_bytes=comm.REDUCE_BUCKET_BYTES if state.bucket_bytes is None else state.bucket_bytes,
            gather_bucket_bytes=comm.GATHER_BUCKET_BYTES if state.bucket_bytes is None else state.bucket_bytes,
        ),
    )
    for name, unit in named_units:
        unit.root_context = context
        unit.fqn = name or "<root>"
    context.first_forward_order = [unit for unit in units if not is_marked(unit)]
    track_root(context)
    tag_collectives(context)  # [Note: tagged collectives] in comm/tags.py
    logger.debug("composable_shard: lazy init of root %s with %d units", type(state.module).__name__, len(units))
    return context
