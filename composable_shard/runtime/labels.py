"""Owns: the label every hook runs under — a profiler range and a debug log
line with the same text, and the error log autograd would otherwise hide.

Knows nothing of: what the hooks do.

Public names: ``hook_label``.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import ContextManager, Iterator, Literal

import torch
import torch.distributed as dist

from .state import UnitState
from .memory_samples import after_hook

__all__ = ["hook_label"]

logger = logging.getLogger(__name__)


def hook_label(state: UnitState, hook: str) -> ContextManager[None]:
    """Run one hook as ``composable_shard::<hook> (<fqn>)``: a profiler range
    and a debug log line, built only while a profiler or debug logging is on
    (a ``record_function`` costs tens of microseconds, and a step runs four
    hooks per unit); on an exception, log rank, unit and state first, since
    autograd hides hook tracebacks. Without either (the common case) a
    small object does the rest, cheaper than a generator-based context
    manager; dynamo traces the generator one (``torch.compile``)."""
    if torch.compiler.is_compiling() or _profiler_enabled() or logger.isEnabledFor(logging.DEBUG):
        return _labelled(state, hook)
    return _Unlabelled(state, hook)


# Dynamo before torch 2.11 cannot rebuild a generator context manager that a
# traced function returned when the block it guards breaks the graph ("NYI:
# Returning a @contextmanager object", torch 2.9.1; 2.11 and 2.13 rebuild
# it): there every hook runs under the generator itself, as the with
# statement's own call, without the cheap path (tests/training/test_compile.py).
_RETURNED_CONTEXTS_SURVIVE_GRAPH_BREAKS = torch.__version__ >= "2.11"


@contextlib.contextmanager
def _labelled(state: UnitState, hook: str) -> Iterator[None]:
    profiling = _profiler_enabled()
    if profiling or logger.isEnabledFor(logging.DEBUG):
        label = f"composable_shard::{hook} ({state.fqn})"
        logger.debug("%s", label)
    with torch.profiler.record_function(label) if profiling else contextlib.nullcontext():
        try:
            yield
            after_hook(state, hook)  # a memory recorder's sample, when one is on
        except Exception:
            _log_failure(state, hook)
            raise


class _Unlabelled:
    """``hook_label`` without a profiler range or debug line: the sample
    after the hook and the error log, as ``_labelled`` runs them."""

    __slots__ = ("state", "hook")

    def __init__(self, state: UnitState, hook: str) -> None:
        self.state = state
        self.hook = hook

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> Literal[False]:
        if kind is None:
            try:
                after_hook(self.state, self.hook)
            except Exception:
                _log_failure(self.state, self.hook)
                raise
        elif issubclass(kind, Exception):
            _log_failure(self.state, self.hook)
        return False  # the exception, if any, goes on


def _log_failure(state: UnitState, hook: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    logger.error(
        "composable_shard::%s (%s) failed on rank %d in state %s",
        hook, state.fqn, rank, state.training_state.name,
    )


def _profiler_enabled() -> bool:
    # Private but present in every supported torch. Under torch.compile a
    # constant False: dynamo cannot trace this query's bool result and would
    # break the graph once more per hook (tests/training/test_compile.py counts them).
    return not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled()


if not _RETURNED_CONTEXTS_SURVIVE_GRAPH_BREAKS:
    hook_label = _labelled  # noqa: F811  (see the flag)
