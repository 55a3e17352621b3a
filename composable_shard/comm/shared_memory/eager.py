"""Owns: running the shared-memory path outside torch.compile's graphs (its
file I/O cannot be traced): a registry of the functions to run eagerly and
their ``torch.compiler.disable``'d versions.

Knows nothing of: what those functions do, process groups, tensors' meaning.

Public names: ``outside_graph``, ``eagerly``, ``build_eager_versions``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["outside_graph", "eagerly", "build_eager_versions"]

# Function -> its torch.compiler.disable'd version (None until built).
_OUTSIDE_GRAPH: dict[Callable[..., Any], Callable[..., Any] | None] = {}


def outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a decorator) as one that torch.compile must run eagerly
    (``eagerly``)."""
    _OUTSIDE_GRAPH[fn] = None
    return fn


def eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (marked ``outside_graph``) as a function torch.compile runs
    eagerly: one graph break, as a gloo collective with ``async_op=True``
    makes one. Built by ``build_eager_versions`` where it could (made here,
    while dynamo traces, it costs a few more breaks, once)."""
    wrapped = _OUTSIDE_GRAPH.get(fn)
    if wrapped is None:
        wrapped = _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
    return wrapped


def build_eager_versions() -> None:
    """Build the eager version of every function marked ``outside_graph``
    that has none yet."""
    for fn, wrapped in list(_OUTSIDE_GRAPH.items()):
        if wrapped is None:
            _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
