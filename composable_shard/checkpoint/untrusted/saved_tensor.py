"""Owns: what one DCP tensor item (a ``torch.save`` of one tensor, at a byte
range of a ``.distcp`` file) stored — its dtype, size, stride, storage
offset and where its raw bytes start in the file — found with torch's own
zip reader (``torch._C.PyTorchFileReader``: record names,
``get_record_offset``) and torch's weights-only unpickler, without reading
the tensor's bytes; and which span of those bytes a requested box covers.

Knows nothing of: DCP plans and planners, destinations, models (reader.py
reads the bytes).

[Note: describing a saved tensor]
The data pickle is unpickled by ``torch._weights_only_unpickler`` (what
``torch.load(weights_only=True)`` runs) with storages made on the meta
device, so nothing but a tensor description is built and a pickle that
wants any other global raises ``pickle.UnpicklingError`` before it is
called. ``torch.load(..., map_location="meta")`` gives the same description
at several times the cost per item in Python, and every load describes every
item it reads, so the cost is the load's (docs/design/checkpoint.md). For
the same reason a description is kept per data-pickle bytes (items of the
same shape repeat), and the zip records are read through a view that serves
the item's first and last 4 KiB from memory. Pinned by
tests/checkpoint/test_reader.py.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
import sys
from typing import Any, BinaryIO

import torch
from torch import _weights_only_unpickler

from .pickle_bounds import check_pickle

__all__ = ["NotDescribed", "SavedTensor", "describe_item", "box_span", "ItemView", "layout_problem"]

_ZIP_MAGIC = b"PK\x03\x04"
_EDGE_BYTES = 4096  # served from memory at each end of an item


class NotDescribed(Exception):
    """This item is not one tensor of the new zip format (the stock reader
    reads it); ``wants_global``: its pickle names a global beyond plain
    data (the caller decides whether that is a refusal)."""

    def __init__(self, why: str, *, wants_global: bool = False) -> None:
        super().__init__(why)
        self.wants_global = wants_global


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """A saved tensor's view of its storage, and where that storage's first
    byte is in the file."""

    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    data_start: int


class ItemView(io.RawIOBase):
    """The bytes ``[start, start + length)`` of a file as a seekable
    read-only file; its first and last ``_EDGE_BYTES`` are read once."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._stream, self.start, self._length, self._position = stream, start, length, 0
        self.head = _pread(stream, start, min(length, _EDGE_BYTES))
        self._tail_start = max(len(self.head), length - _EDGE_BYTES)
        self._tail = _pread(stream, start + self._tail_start, length - self._tail_start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        # torch's zip reader seeks before every read: kept to plain arithmetic.
        if whence == io.SEEK_SET:
            self._position = offset
        elif whence == io.SEEK_END:
            self._position = self._length + offset
        else:
            self._position += offset
        return self._position

    def readinto(self, target: Any) -> int:
        at, head = self._position, self.head
        count = min(len(target), self._length - at)
        if count <= 0:
            return 0
        if at + count <= len(head):
            target[:count] = head[at : at + count]
        elif at >= self._tail_start:
            start = at - self._tail_start
            target[:count] = self._tail[start : start + count]
        else:
            data = _pread(self._stream, self.start + at, count)
            count = len(data)
            target[:count] = data
        self._position = at + count
        return count


def _pread(stream: BinaryIO, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``offset``: one ``pread`` on a file (a
    seek and a read cost two system calls per read, ~1,400 per rank per
    load of the benchmark's GPT; docs/design/checkpoint.md), else seek and
    read."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: an in-memory stream
        stream.seek(offset)
        return stream.read(length)
    return os.pread(descriptor, length, offset)


class _MetaStorages:
    """``persistent_load`` for the data pickle: each storage on the meta
    device (no bytes read), its record key remembered."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
            raise NotDescribed("an unexpected persistent id")
        _, storage_type, key, _, numel = saved_id
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise NotDescribed("an unexpected storage")
        self.keys.append(key)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return torch.storage.TypedStorage(
            wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype, _internal=True
        )


def describe_item(view: ItemView) -> SavedTensor:
    """The saved tensor of one item (see [Note: describing a saved tensor]).
    Raises ``NotDescribed`` for an item of another form, and torch's
    ``RuntimeError`` for a zip archive that does not parse."""
    if view.head[:4] != _ZIP_MAGIC:
        raise NotDescribed("not a zip archive (another serialization)")
    archive = torch._C.PyTorchFileReader(view)  # type: ignore[call-overload]  # any file-like object with read/seek/tell
    if not archive.has_record("data.pkl"):
        raise NotDescribed("no data.pkl record")
    if archive.has_record("byteorder"):
        if archive.get_record("byteorder").decode("ascii", "replace") != sys.byteorder:
            raise NotDescribed("another byte order")
    elif sys.byteorder != "little":
        raise NotDescribed("a checkpoint of unknown byte order")
    data_pickle = archive.get_record("data.pkl")
    described = _DESCRIBED.get(data_pickle)
    if described is None:
        check_pickle(data_pickle, "its data.pkl")
        described = _describe_pickle(data_pickle)
        if len(_DESCRIBED) >= _DESCRIBED_MAX:
            _DESCRIBED.clear()
        _DESCRIBED[data_pickle] = described
    dtype, key, storage_numel, storage_offset, size, stride = described
    data_start = archive.get_record_offset(f"data/{key}")
    storage_bytes = storage_numel * torch.empty((), dtype=dtype).element_size()
    if data_start < 0 or data_start + storage_bytes > view.seek(0, io.SEEK_END):
        raise NotDescribed("a storage record past the item's end")
    return SavedTensor(dtype, storage_numel, storage_offset, size, stride, view.start + data_start)


# A data pickle's bytes -> (dtype, storage key, storage numel, storage offset,
# size, stride). The same bytes unpickle to the same plain tensor, and items
# of the same shape repeat (every block of a model), so each is unpickled once.
_DESCRIBED: dict[bytes, tuple[torch.dtype, str, int, int, tuple[int, ...], tuple[int, ...]]] = {}
_DESCRIBED_MAX = 4096


def _describe_pickle(data_pickle: bytes) -> tuple[torch.dtype, str, int, int, tuple[int, ...], tuple[int, ...]]:
    storages = _MetaStorages()
    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data_pickle), encoding="utf-8")
    unpickler.persistent_load = storages  # type: ignore[method-assign]  # as torch.load sets it
    try:
        tensor = unpickler.load()
    except pickle.UnpicklingError as exc:
        raise NotDescribed(f"its pickle ({' '.join(str(exc).split())[:200]})", wants_global=True) from None
    if type(tensor) is not torch.Tensor or tensor.device.type != "meta" or len(storages.keys) != 1:
        raise NotDescribed("a pickle of something other than one plain tensor")
    storage_numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    storage_offset = int(tensor.storage_offset())  # a plain tensor's: an int (not a SymInt)
    return tensor.dtype, storages.keys[0], storage_numel, storage_offset, tuple(tensor.size()), tuple(tensor.stride())


@functools.lru_cache(maxsize=4096)
def layout_problem(size: tuple[int, ...], stride: tuple[int, ...], storage_offset: int, storage_numel: int) -> str | None:
    """What is wrong with a saved tensor's view of its storage (None if
    nothing): a negative offset or stride, an extent past the storage, or a
    stride of 0 along a dimension longer than 1 (an expanded tensor: DCP's
    writer clones those, so a stored one only inflates a few bytes).
    Memoized: a pure function of its arguments, asked once per item read,
    and a checkpoint's items repeat a few layouts."""
    if storage_offset < 0 or any(st < 0 for st in stride) or len(stride) != len(size):
        return f"a negative storage offset or stride ({storage_offset}, {stride})"
    if any(st == 0 and n > 1 for st, n in zip(stride, size)):
        return f"a stride of 0 (an expanded tensor of size {size} from {storage_numel} stored elements)"
    if all(n > 0 for n in size) and storage_offset + sum((n - 1) * st for n, st in zip(size, stride)) >= storage_numel:
        return f"a view past its storage of {storage_numel} elements"
    return None


def box_span(saved: SavedTensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int, bool] | None:
    """The requested box of the saved tensor as (first storage element,
    elements spanned from it, whether they are exactly the box), or None if
    the request does not fit the saved tensor."""
    if len(offsets) != len(saved.size) or len(lengths) != len(saved.size):
        return None
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, saved.size)):
        return None
    first = saved.storage_offset + sum(o * st for o, st in zip(offsets, saved.stride))
    if any(n == 0 for n in lengths):
        return first, 0, True
    span = 1 + sum((n - 1) * st for n, st in zip(lengths, saved.stride))
    if first < 0 or first + span > saved.storage_numel:
        return None
    return first, span, _is_contiguous(lengths, saved.stride) and span == math.prod(lengths)


def _is_contiguous(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major contiguity as torch defines it (size-1 dimensions ignored)."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
