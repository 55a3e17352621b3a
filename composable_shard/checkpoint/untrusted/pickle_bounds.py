"""Owns: a walk over a pickle's opcodes, without building anything, that
bounds what unpickling it would cost: the number of objects, the memo's
size and indices, and the object graph's depth and its size as a tree (what
``hash``, ``==`` or ``str`` of it would visit) — refusing a pickle beyond
them with ``CheckpointError`` before any unpickler sees it.

Knows nothing of: which globals are admitted (safe_pickle.py), files, DCP.

[Note: bounded pickles]
A few hundred bytes of pickle can describe a DAG of tuples sharing their
halves (each level ``(t, t)`` through the memo): building it is cheap, but
using it as a dict key hashes 2**depth tuples, and ``str`` of it is as
large. So before unpickling, ``check_pickle`` replays the opcodes on a
model of the stack in which every object is a node and every memo ``GET``
shares a node, then measures the resulting graph: its depth
(``MAX_DEPTH``) and its size expanded as a tree (at most ``EXPANDED_BASE``
plus ``EXPANDED_PER_NODE`` per object: honest pickles share leaves only).
Memo indices beyond the number of objects are refused (the C unpickler
sizes its memo to the largest index). Pinned by
tests/checkpoint/test_hostile.py.

[Note: pickles of a known shape]
The walk costs ~0.6 us per opcode in Python (30 ms for the 115 KB
``.metadata`` of a 25M-parameter GPT with AdamW), and every save writes a
new ``.metadata`` (DCP stamps a fresh ``save_id``), so a cache of verdicts by
content never hits on a training run's next checkpoint. The walk's verdict
depends only on the opcodes and the arguments that steer the model (memo
indices, lengths), never on the bytes of a string, bytes or binary-number
argument. So a passed pickle also keeps where those payload bytes lie; a
new pickle of the same length whose bytes differ from it only inside those
payloads has the same opcodes at the same places and the same verdict, and
is admitted after a byte comparison (~0.1 ms) instead of a walk. Any other
difference (an opcode, a length, a memo index) walks it. Pinned by
tests/checkpoint/test_pickle_bounds.py.
"""

from __future__ import annotations

import bisect
import io
import pickletools
import re
from typing import Any

from ..errors import CheckpointError

__all__ = ["check_pickle", "check_pickles", "check_saved_pickles", "MAX_OBJECTS", "MAX_DEPTH"]

MAX_OBJECTS = 20_000_000
MAX_DEPTH = 200
EXPANDED_BASE = 1_000_000
EXPANDED_PER_NODE = 16

_MARK = -1
# Opcodes that change their first stack argument in place and push it back.
_IN_PLACE = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "BUILD", "ADDITEMS"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}


def _refuse(what: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{what}: its pickle {why}; refused before unpickling it. The checkpoint is damaged or hostile; load another one."
    )


def check_pickles(data: bytes, what: str, count: int) -> None:
    """``check_pickle`` on each of the first ``count`` pickles stored one
    after another in ``data`` (a legacy ``torch.save`` file holds five)."""
    stream = io.BytesIO(data)
    for _ in range(count):
        check_pickle(stream, what)


# Opcodes whose argument is a payload the walk ignores (a string, bytes or a
# binary number): code -> bytes before the payload (the opcode and any
# length field). See [Note: pickles of a known shape].
_PAYLOAD_HEADER: dict[Any, int] = {}
for _op in pickletools.opcodes:
    if _op.name in ("SHORT_BINUNICODE", "SHORT_BINBYTES"):
        _PAYLOAD_HEADER[_op.code] = 2
    elif _op.name in ("BINUNICODE", "BINBYTES"):
        _PAYLOAD_HEADER[_op.code] = 5
    elif _op.name in ("BINUNICODE8", "BINBYTES8", "BYTEARRAY8"):
        _PAYLOAD_HEADER[_op.code] = 9
    elif _op.name in ("BININT", "BININT1", "BININT2", "BINFLOAT"):
        _PAYLOAD_HEADER[_op.code] = 1
_FIXED_PAYLOAD = {"BININT": 4, "BININT1": 1, "BININT2": 2, "BINFLOAT": 8}

# What each opcode does to the model of the stack: (kind, arguments popped
# before the MARK or without one, whether it pops to a MARK, objects pushed,
# bytes before its payload or 0).
_GET, _PUT, _DUP, _IN, _OTHER = range(5)
_PLANS: dict[Any, tuple[int, int, bool, tuple[bool, ...], int]] = {}
for _op in pickletools.opcodes:
    _before, _after = _op.stack_before, _op.stack_after
    _marked = pickletools.markobject in _before
    _PLANS[_op.code] = (
        _GET if _op.name in _GETS else _PUT if _op.name in _PUTS else _DUP if _op.name == "DUP" else _IN if _op.name in _IN_PLACE else _OTHER,
        _before.index(pickletools.markobject) if _marked else len(_before),
        _marked,
        tuple(kind is pickletools.markobject for kind in _after),
        _PAYLOAD_HEADER.get(_op.code, 0),
    )

# Pickles already found within bounds (the same .metadata is read several
# times per load, and a load reads a dozen small object items): their bytes,
# most recent last, at most _PASSED_MAX of them and _CACHED_BYTES in all;
# none over _CACHED_BYTES // 2 is kept.
_PASSED: dict[bytes, None] = {}
_PASSED_MAX = 64
_CACHED_BYTES = 64 << 20
# Passed pickles of at least _SHAPE_MIN bytes: (bytes, payload starts,
# payload ends), most recent last, at most _SHAPES_MAX of them and
# _CACHED_BYTES in all (mostly the same bytes objects as _PASSED's).
_SHAPES: list[tuple[bytes, list[int], list[int]]] = []
_SHAPE_MIN = 4096
_SHAPES_MAX = 8
_BLOCK = 4096
_NONZERO = re.compile(rb"[^\x00]+")


def check_pickle(source: Any, what: str) -> None:
    """Refuse the pickle at ``source`` (bytes, or a binary file positioned
    at it, left just after its STOP) if it exceeds the bounds of [Note:
    bounded pickles]."""
    key = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else None
    if key is not None and (key in _PASSED or _same_shape_as_passed(key)):
        return
    stream = io.BytesIO(key) if key is not None else source
    shaped = key is not None and len(key) >= _SHAPE_MIN
    starts: list[int] = []
    ends: list[int] = []
    children: list[list[int] | None] = []  # node -> its children (None: a leaf)
    stack: list[int] = []
    memo: dict[int, int] = {}
    memo_count = 0
    plans = _PLANS
    try:
        for opcode, arg, position in pickletools.genops(stream):
            kind, extra, marked, pushes, header = plans[opcode.code]
            if header and shaped and position is not None:  # shaped: a BytesIO, whose positions are never None
                starts.append(position + header)
                ends.append(position + header + _payload_length(opcode.name, arg))
            if kind == _GET:
                if arg not in memo:
                    raise _refuse(what, f"reads the memo at {arg}, which was never written")
                stack.append(memo[arg])
                continue
            if kind == _PUT:
                if not stack or stack[-1] == _MARK:
                    raise _refuse(what, "memoizes nothing")
                index = memo_count if arg is None else arg
                if not isinstance(index, int) or index < 0 or index > len(children) + 16:
                    raise _refuse(what, f"writes the memo at {index!r:.40}, beyond its {len(children)} objects")
                memo[index] = stack[-1]
                memo_count += 1
                continue
            if kind == _DUP:
                stack.append(stack[-1])
                continue
            popped: list[int] = []
            if marked:
                while stack and stack[-1] != _MARK:
                    popped.append(stack.pop())
                if not stack:
                    raise _refuse(what, f"has {opcode.name} without a MARK")
                stack.pop()
            for _ in range(extra):
                if not stack or stack[-1] == _MARK:
                    raise _refuse(what, f"has {opcode.name} on a short stack")
                popped.append(stack.pop())
            if kind == _IN:
                target = popped[-1]  # the first argument, popped last
                node = children[target]
                if node is None:
                    children[target] = node = []
                node.extend(popped[:-1])
                stack.append(target)
                continue
            for is_mark in pushes:
                if is_mark:
                    stack.append(_MARK)
                else:
                    children.append(popped or None)
                    stack.append(len(children) - 1)
            if len(children) > MAX_OBJECTS:
                raise _refuse(what, f"builds more than {MAX_OBJECTS} objects")
    except CheckpointError:
        raise
    except (ValueError, EOFError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise _refuse(what, f"is malformed ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    _check_graph(children, what)
    if key is not None:
        _remember(key, starts, ends if shaped else None)


def _payload_length(name: str, arg: Any) -> int:
    if name in _FIXED_PAYLOAD:
        return _FIXED_PAYLOAD[name]
    if isinstance(arg, str):  # pickletools decodes as the unpickler does
        return len(arg) if arg.isascii() else len(arg.encode("utf-8", "surrogatepass"))
    return len(arg)


def _remember(key: bytes, starts: list[int], ends: list[int] | None) -> None:
    """Keep a passed pickle's bytes (and, for a large one, where its
    payloads lie), dropping the oldest beyond the caches' bounds."""
    if len(key) > _CACHED_BYTES // 2:
        return
    _PASSED[key] = None
    while len(_PASSED) > _PASSED_MAX or sum(map(len, _PASSED)) > _CACHED_BYTES:
        del _PASSED[next(iter(_PASSED))]
    if ends is not None:
        _SHAPES.append((key, starts, ends))
        while len(_SHAPES) > _SHAPES_MAX or sum(len(shape[0]) for shape in _SHAPES) > _CACHED_BYTES:
            del _SHAPES[0]


def _same_shape_as_passed(data: bytes) -> bool:
    """Whether ``data`` differs from a passed pickle of its length only
    inside that pickle's payloads ([Note: pickles of a known shape])."""
    for passed, starts, ends in reversed(_SHAPES):
        if len(passed) == len(data) and _differs_only_in(passed, data, starts, ends):
            return True
    return False


def _differs_only_in(passed: bytes, data: bytes, starts: list[int], ends: list[int]) -> bool:
    before, after = memoryview(passed), memoryview(data)
    for block in range(0, len(data), _BLOCK):
        if before[block : block + _BLOCK] == after[block : block + _BLOCK]:
            continue
        chunk = passed[block : block + _BLOCK]
        width = len(chunk)
        changed = (int.from_bytes(chunk, "little") ^ int.from_bytes(data[block : block + width], "little")).to_bytes(width, "little")
        for run in _NONZERO.finditer(changed):
            first, last = block + run.start(), block + run.end()  # [first, last) changed
            # The payload starting at or before `first` must reach `last`.
            index = bisect.bisect_right(starts, first) - 1
            if index < 0 or ends[index] < last:
                return False
    return True


def _check_graph(children: list[list[int] | None], what: str) -> None:
    """The depth and tree size of the graph (cycles cut where they close)."""
    count = len(children)
    size = [0] * count
    depth = [0] * count
    state = bytearray(count)  # 0 new, 1 on the path, 2 done
    limit = EXPANDED_BASE + EXPANDED_PER_NODE * count
    for root in range(count):
        if state[root]:
            continue
        path = [(root, 0)]
        state[root] = 1
        while path:
            node, next_child = path[-1]
            kids = children[node]
            if kids is not None and next_child < len(kids):
                path[-1] = (node, next_child + 1)
                child = kids[next_child]
                if state[child] == 0:
                    state[child] = 1
                    path.append((child, 0))
                    if len(path) > MAX_DEPTH:
                        raise _refuse(what, f"nests objects deeper than {MAX_DEPTH}")
                continue
            path.pop()
            total, deepest = 1, 0
            for child in kids or ():
                if state[child] == 2:
                    total += size[child]
                    deepest = max(deepest, depth[child] + 1)
                else:  # a cycle closes here: counted once
                    total += 1
            if total > limit:
                raise _refuse(what, f"shares objects so that walking it visits more than {limit} of them (a DAG bomb)")
            if deepest > MAX_DEPTH:
                raise _refuse(what, f"nests objects deeper than {MAX_DEPTH}")
            size[node], depth[node], state[node] = total, deepest, 2


def check_saved_pickles(data: bytes, what: str) -> None:
    """``check_pickle`` on the pickles of a ``torch.save`` file: the
    ``data.pkl`` record of the zip format, or the five pickles the legacy
    format starts with."""
    if data[:4] == b"PK\x03\x04":
        import torch

        try:
            archive = torch._C.PyTorchFileReader(io.BytesIO(data))
            record = archive.get_record("data.pkl")
        except RuntimeError as exc:
            raise _refuse(what, f"archive does not parse ({' '.join(str(exc).split())[:120]})") from None
        check_pickle(bytes(record), what)
    else:
        check_pickles(data, what, 5)
