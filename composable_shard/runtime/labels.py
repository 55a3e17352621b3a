"""Owns: the label every hook runs under — a profiler range and a debug log
line with the same text, and the error log autograd would otherwise hide.

Knows nothing of: what the hooks do.

Public names: ``hook_label``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist

from .state import UnitState
from .memory_samples import after_hook

__all__ = ["hook_label"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def hook_label(state: UnitState, hook: str) -> Iterator[None]:
    """Run one hook as ``composable_shard::<hook> (<fqn>)``: a profiler range
    and a debug log line, built only while a profiler or debug logging is on
    (a ``record_function`` costs tens of microseconds, and a step runs four
    hooks per unit); on an exception, log rank, unit and state first, since
    autograd hides hook tracebacks."""
    profiling = _profiler_enabled()
    if profiling or logger.isEnabledFor(logging.DEBUG):
        label = f"composable_shard::{hook} ({state.fqn})"
        logger.debug("%s", label)
    with torch.profiler.record_function(label) if profiling else contextlib.nullcontext():
        try:
            yield
            after_hook(state, hook)  # a memory recorder's sample, when one is on
        except Exception:
            rank = dist.get_rank() if dist.is_initialized() else 0
            logger.error(
                "composable_shard::%s (%s) failed on rank %d in state %s",
                hook, state.fqn, rank, state.training_state.name,
            )
            raise


def _profiler_enabled() -> bool:
    # Private but present in every supported torch. Under torch.compile a
    # constant False: dynamo cannot trace this query's bool result and would
    # break the graph once more per hook (tests/training/test_compile.py counts them).
    return not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled()
