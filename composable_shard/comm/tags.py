"""Owns: the tag a collective carries to say whose it is — a small number
naming the unit (and flat parameter) an all-gather or a gradient reduction
belongs to, set by the caller around the launch and read by the transport
that can carry it — and the tags' names for error messages.

Knows nothing of: units or flat parameters (callers register opaque keys
with a number and a name), how a transport carries the tag.

Public names: ``register``, ``collective_of``, ``current_tag``,
``name_of``, ``MAX_TAG``.

[Note: tagged collectives]
Ranks pair collectives by order alone: a unit that runs on one rank and not
on another (conditional compute, an expert without tokens) makes the ranks'
sequences differ, and then either a collective waits forever or two units'
collectives of equal size pair up and mix their bytes. Every collective of a
flat parameter therefore carries its unit's tag: the shared-memory transport
publishes it beside each round's kind and size (``signature_of`` in
shared_memory/slots.py), and gloo's message path exchanges it in a tiny
all-gather beside the collective (tag_check.py), so the first collective
where two ranks disagree fails on each of them at once, naming both units.
The tag is a number, the unit's position in its root's tree, the same on
every rank; collectives launched outside ``collective_of`` are untagged (0).
NCCL carries none. Pinned by tests/controls/test_skipped_units.py.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["register", "collective_of", "current_tag", "name_of", "MAX_TAG"]

# Tags fit in the bits of a shared-memory signature above kind and size.
MAX_TAG = (1 << 17) - 1

# A registered key (a flat-parameter handle) carries its tag in this
# attribute, so it goes with the key; a registry beside the keys (weak, to
# drop deleted models) is what hooks torch.compile traces guarded on, and
# it shrinks as earlier models are collected: a guard on it failed to build
# in a long test run (tests/training/test_compile.py). Tag -> its name.
_TAG_ATTRIBUTE = "_composable_shard_collective_tag"
_NAMES: dict[int, str] = {}
# The tag of the collective being launched on this thread (0: untagged).
_CURRENT = threading.local()


def register(key: object, tag: int, name: str) -> None:
    """Collectives launched inside ``collective_of(key)`` carry ``tag``,
    named ``name`` in errors (every rank must register the same)."""
    tag = min(tag, MAX_TAG)
    setattr(key, _TAG_ATTRIBUTE, tag)
    _NAMES[tag] = name


@contextlib.contextmanager
def collective_of(key: object) -> Iterator[None]:
    """Tag the collectives launched in this block with ``key``'s tag."""
    previous = getattr(_CURRENT, "tag", 0)
    _CURRENT.tag = getattr(key, _TAG_ATTRIBUTE, 0)
    try:
        yield
    finally:
        _CURRENT.tag = previous


def current_tag() -> int:
    """The tag of the collective being launched on this thread (0: none)."""
    return getattr(_CURRENT, "tag", 0)


def name_of(tag: int) -> str:
    """What a tag names, in words."""
    if tag == 0:
        return "no unit"
    return _NAMES.get(tag, f"tag {tag}")
