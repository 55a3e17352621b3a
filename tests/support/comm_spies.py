"""Owns: spies on ``composable_shard.comm``'s collectives that tests install to
count calls, dtypes and sizes (both call through to the real collectives).

Knows nothing of: what the tests assert about the calls.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
from typing import Any, Callable, Iterator, TypeVar
from unittest import mock

import torch

from composable_shard import comm

# Every function composable_shard.comm defines (only it calls torch.distributed).
COMM_FUNCTIONS = tuple(
    name for name, value in vars(comm).items() if inspect.isfunction(value) and value.__module__ == comm.__name__
)


class CollectiveSpy:
    """Wraps every ``composable_shard.comm`` collective with a function that
    records (name, dtypes of its tensor arguments) and calls through."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []
        # (name, numel of the first tensor argument: a reduce-scatter's output).
        self.sizes: list[tuple[str, int]] = []
        # The calls made from outside comm (the runtime's), not from one another.
        self.outermost: list[str] = []
        # Each gradient reduction issued: (its collective, elements of its
        # output, reduce dtype); see reductions_issued.
        self.reductions: list[tuple[str, int, torch.dtype]] = []
        self._depth = 0
        self._inside_bucket = 0

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(name for name, _ in self.calls)

    def all_gathers_issued(self) -> int:
        """The all-gathers the runtime issued: each unit's own
        (``all_gather_into``) and each bucket's (``all_gather_together``,
        one collective whichever way the transport moves it)."""
        return sum(name in ("all_gather_into", "all_gather_together") for name in self.outermost)

    def reductions_issued(self, collective: str | None = None) -> list[tuple[int, torch.dtype]]:
        """(output elements, dtype) of each reduce-scatter or all-reduce
        (``collective``: only those) that reduced gradients: a flat
        parameter's own (``reduce_scatter``, ``all_reduce``) and each
        bucket's (``reduce_grads_together``, one collective whichever way
        the transport moves it)."""
        return [(numel, dtype) for name, numel, dtype in self.reductions if collective in (None, name)]

    def _record_reduction(self, name: str, args: tuple) -> None:
        if name == "reduce_grads_together":
            grads, settings = args[0], args[1]
            groups = settings[0].groups
            total = sum(grad.numel() for grad in grads)
            if groups.is_sharded:
                self.reductions.append(("reduce_scatter", total // groups.shard_world_size, settings[0].reduce_dtype))
            else:
                self.reductions.append(("all_reduce", total, settings[0].reduce_dtype))
        elif name in ("reduce_scatter", "all_reduce") and not self._inside_bucket:
            self.reductions.append((name, args[0].numel(), args[0].dtype))

    def dtypes(self, name: str) -> set[torch.dtype]:
        return {dtype for called, dtypes in self.calls if called == name for dtype in dtypes}

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((name, tuple(a.dtype for a in tensors)))
            if tensors:
                self.sizes.append((name, tensors[0].numel()))
            if self._depth == 0:
                self.outermost.append(name)
            self._record_reduction(name, args)
            bucket = name == "reduce_grads_together"
            self._depth += 1
            self._inside_bucket += bucket
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                self._inside_bucket -= bucket

        return spy

    @contextlib.contextmanager
    def watching(self) -> Iterator[CollectiveSpy]:
        originals = {name: getattr(comm, name) for name in COMM_FUNCTIONS}
        for name, function in originals.items():
            setattr(comm, name, self._wrap(name, function))
        try:
            yield self
        finally:
            for name, function in originals.items():
                setattr(comm, name, function)


class CommSpy:
    """Counts calls of composable_shard.comm's collectives (calls through)."""

    NAMES = ("all_gather_into", "reduce_scatter", "all_reduce", "all_reduce_max", "broadcast", "broadcast_object",
             "all_gather_object")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "CommSpy":
        for name in self.NAMES:
            original = getattr(comm, name)
            self.saved[name] = original

            def spy(*args: Any, _name: str = name, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                self.calls.append(_name)
                return _original(*args, **kwargs)

            setattr(comm, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.saved.items():
            setattr(comm, name, original)


def reduce_bucket_bytes(nbytes: int) -> contextlib.AbstractContextManager[Any]:
    """Units sharded and trees initialised inside reduce small gradients in
    buckets of ``nbytes`` ([Note: coalesced reductions]; 0: every flat
    parameter alone); restored after (the worker serves other tests)."""
    return mock.patch.object(comm, "REDUCE_BUCKET_BYTES", nbytes)


def gather_bucket_bytes(nbytes: int) -> contextlib.AbstractContextManager[Any]:
    """Trees initialised inside coalesce the all-gathers of small units up
    to ``nbytes`` ([Note: coalesced all-gathers]; 0: every flat parameter
    alone); restored after."""
    return mock.patch.object(comm, "GATHER_BUCKET_BYTES", nbytes)


@contextlib.contextmanager
def collectives_alone() -> Iterator[None]:
    """Every flat parameter gathered and reduced in collectives of its own,
    for tests that pin the order or number of one unit's collectives;
    tests/runtime/test_coalesced_*.py pin the buckets."""
    with reduce_bucket_bytes(0), gather_bucket_bytes(0):
        yield


def reductions_alone() -> contextlib.AbstractContextManager[None]:
    """Every flat parameter reduced in a collective of its own, for tests
    that count reductions per flat parameter;
    tests/runtime/test_coalesced_reductions.py counts the buckets."""
    return reduce_bucket_bytes(0)


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _run_under(context: Callable[[], contextlib.AbstractContextManager[None]], fn: _Fn) -> _Fn:
    """``fn`` (a worker function) run inside ``context()``."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def with_reductions_alone(fn: _Fn) -> _Fn:
    """A worker function run under ``reductions_alone``."""
    return _run_under(reductions_alone, fn)


def with_collectives_alone(fn: _Fn) -> _Fn:
    """A worker function run under ``collectives_alone``."""
    return _run_under(collectives_alone, fn)


def shared_memory_slot_bytes(slot_bytes: int) -> contextlib.AbstractContextManager[Any]:
    """Groups set up inside get shared-memory slots of ``slot_bytes`` (the
    module's value is restored after: the worker serves other tests)."""
    from composable_shard.comm import shared_memory

    return mock.patch.object(shared_memory, "SLOT_BYTES", slot_bytes)


def shared_memory_switched_off() -> contextlib.AbstractContextManager[Any]:
    """Groups that decide their transport inside, and plans made inside,
    take gloo's messages, not shared memory (the environment is restored
    after: the worker serves other tests)."""
    from composable_shard.comm import transport

    return mock.patch.dict(os.environ, {transport.ENV_SWITCH: "0"})


def gloo_only_group(world_size: int) -> Any:
    """A new group of every rank that decided on gloo's messages, not shared
    memory."""
    import torch.distributed as dist

    from composable_shard.comm import transport

    with shared_memory_switched_off():
        group = dist.new_group(list(range(world_size)))
        if transport.shared_memory_of(group) is not None:  # decided here, with the switch off
            raise AssertionError("gloo_only_group: the new group took shared memory with the switch off")
    return group
