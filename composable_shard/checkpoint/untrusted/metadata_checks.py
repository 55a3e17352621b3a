"""Owns: checking a DCP ``Metadata`` read from a checkpoint before anything
is planned from it — every entry of the types DCP writes, every tensor's
chunks covering it exactly (no gap, no overlap, in bounds), every chunk and
bytes item with its storage entry, every storage entry naming a file inside
the directory (safe_files.py) at a byte range inside that file and large
enough for the chunk it claims to hold — so destinations sized from the
metadata are bounded by the bytes really there.

Knows nothing of: models, optimizers, how items are read (reader.py),
pickles (the metadata is already unpickled, as data).

[Note: checked metadata]
Only the total size of a tensor's chunks used to be compared, so a chunk
list with a gap loaded uninitialised memory; a claimed size beyond the
file allocated it. ``check_metadata`` raises ``CheckpointError`` naming the
file and the item for each of these, before any destination exists; it
costs a few operations per chunk and one ``fstat`` per file. Items with
transforms (compression) are bounded by their stored length only. Pinned by
tests/checkpoint/test_hostile.py.

[Note: a metadata verdict kept]
``load_checkpoint`` reads ``.metadata`` twice (its own destinations, then
``dcp.load``), and checking it costs ~1 ms per 500 storage entries. The
verdict is a function of the metadata object, the directory and, per file
it names, where the name resolves and whether that is a regular file of
what size. ``check_metadata_once`` keeps the verdict keyed by the exact
bytes and how they were unpickled (the same bytes and admitted globals give
the same objects) and the directory's real path, with each file's resolved
path, device, inode, size and mtime; a later call with the same key
re-resolves and re-``stat``s every file (~20 us each) and skips the check
only if all agree, so every input of the verdict is the same. A re-saved
checkpoint has new bytes (DCP's ``save_id``) and is checked in full.
Pinned by tests/checkpoint/test_hostile.py
(``test_a_kept_metadata_verdict_is_dropped_when_a_file_changes``).
"""

from __future__ import annotations

import math
import os
from operator import add, le
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import CheckpointError
from .safe_files import regular_file_stat, resolve_inside

__all__ = ["check_metadata", "check_metadata_once", "MalformedMetadataError"]


class MalformedMetadataError(CheckpointError):
    """A checkpoint's ``.metadata`` is not what DCP writes, or names files
    and byte ranges that are not there."""


# (relative name, real path, st_dev, st_ino, st_size, st_mtime_ns) of a data file.
_FileFacts = tuple[str, str, int, int, int, int]
# Verdicts of check_metadata_once: key -> the facts of every file it named.
_VERDICTS: dict[tuple[Any, ...], tuple[_FileFacts, ...]] = {}
_VERDICTS_MAX = 4
_VERDICT_BYTES_MAX = 16 << 20  # a larger .metadata is checked every time (the key holds its bytes)


def check_metadata_once(
    metadata: Any, content: bytes, reading: Any, where: str, directory: str | os.PathLike[str], *, allow_links_outside: bool = False
) -> None:
    """``check_metadata``, not repeated for the same ``.metadata`` bytes
    ``content`` unpickled the same way (``reading``, hashable: what decides
    the objects the bytes become) in the same directory while every file it
    names still resolves to the same regular file with the same (device,
    inode, size, mtime) — see [Note: a metadata verdict kept]."""
    key: tuple[Any, ...] | None = None
    if len(content) <= _VERDICT_BYTES_MAX:
        try:
            key = (content, reading, os.path.realpath(directory), bool(allow_links_outside))
            hash(key)
        except TypeError:  # an unhashable admitted global: check every time
            key = None
    if key is not None:
        known = _VERDICTS.get(key)
        if known is not None and _unchanged(known, directory, allow_links_outside):
            return
    facts: list[_FileFacts] = []
    check_metadata(metadata, where, directory, allow_links_outside=allow_links_outside, facts=facts)
    if key is not None:
        _VERDICTS.pop(key, None)
        _VERDICTS[key] = tuple(facts)
        while len(_VERDICTS) > _VERDICTS_MAX:
            del _VERDICTS[next(iter(_VERDICTS))]


def _unchanged(facts: tuple[_FileFacts, ...], directory: str | os.PathLike[str], allow_links_outside: bool) -> bool:
    """Whether each file still resolves as it did, to a regular file with
    the same identity and size (anything else: check again, which raises
    the exact refusal if there is one)."""
    for name, real, device, inode, size, mtime_ns in facts:
        try:
            resolved = resolve_inside(directory, name, "", allow_links_outside=allow_links_outside)
            info = regular_file_stat(resolved, "")
        except CheckpointError:
            return False
        if (os.fspath(resolved), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) != (real, device, inode, size, mtime_ns):
            return False
    return True


def _fail(where: str, item: str, why: str) -> MalformedMetadataError:
    return MalformedMetadataError(
        f"'{where}': the item '{item:.200}' {why}. The checkpoint is damaged, incomplete or hostile; load another one. "
        "Nothing was loaded."
    )


def check_metadata(
    metadata: Any, where: str, directory: str | os.PathLike[str], *, allow_links_outside: bool = False, facts: list[_FileFacts] | None = None
) -> dict[str, int]:
    """Check ``metadata`` (read from ``where``) as [Note: checked metadata]
    says; returns each data file's name -> size (and appends what the
    verdict depended on about each file to ``facts``)."""
    if not isinstance(metadata, Metadata):
        raise MalformedMetadataError(f"'{where}' holds a {type(metadata).__name__}, not DCP metadata. Load a torch.distributed.checkpoint directory.")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict):
        raise _fail(where, "state_dict_metadata", "is not a dict")
    if storage is None:
        storage = {}
    if not isinstance(storage, dict):
        raise _fail(where, "storage_data", "is not a dict")
    if metadata.planner_data is not None and not isinstance(metadata.planner_data, dict):
        raise _fail(where, "planner_data", "is not a dict")
    for key, path in (metadata.planner_data or {}).items():
        if key not in entries:
            continue  # not a mapping of a saved key (nothing reads it)
        if not isinstance(path, (tuple, list)) or not path:
            raise _fail(where, str(key), "has a malformed path in planner_data")
        for part in path:  # a loop, not all(<genexpr>): a few hundred paths per load
            if not isinstance(part, (str, int)):
                raise _fail(where, str(key), "has a malformed path in planner_data")
    files, bounds = _check_storage(storage, where, directory, allow_links_outside, facts)
    for fqn, md in entries.items():
        if not isinstance(fqn, str):
            raise _fail(where, repr(fqn), "has a key that is not a string")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md, bounds, where)
        elif isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in bounds:
                raise _fail(where, fqn, "has no storage entry")
        else:
            raise _fail(where, fqn, f"is a {type(md).__name__}, not tensor or bytes metadata")
    return files


def _check_storage(
    storage: dict[Any, Any], where: str, directory: str | os.PathLike[str], allow_links_outside: bool, facts: list[_FileFacts] | None = None
) -> tuple[dict[str, int], dict[tuple[str, Any], int | None]]:
    """Each storage entry checked; returns the data files' sizes (relative
    path -> size) and each entry's byte bound by (fqn, offset) — its length,
    None for a transformed item (bounded by its stored length only) — for
    ``_check_tensor`` (a plain tuple key: no ``MetadataIndex`` built per
    chunk, [Note: checked metadata]); appends each file's facts to
    ``facts``."""
    sizes: dict[str, int] = {}  # relative path -> size
    bounds: dict[tuple[str, Any], int | None] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _fail(where, repr(index)[:100], "has a malformed storage key")
        name: Any = getattr(info, "relative_path", None)  # untrusted: resolve_inside refuses a non-str
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _fail(where, index.fqn, f"has a malformed byte range (offset {offset!r:.40}, length {length!r:.40})")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and (not isinstance(descriptors, (list, tuple)) or not all(isinstance(d, str) for d in descriptors)):
            raise _fail(where, index.fqn, "has malformed transform descriptors")
        size = sizes.get(name) if type(name) is str else None
        if size is None:  # a file not seen yet (or not a name: resolve_inside says so)
            real = resolve_inside(directory, name, f"'{where}': the item '{index.fqn}'", allow_links_outside=allow_links_outside)
            info = regular_file_stat(real, f"'{where}': the item '{index.fqn}'")
            size = sizes[name] = info.st_size
            if facts is not None:
                facts.append((name, os.fspath(real), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
        if offset + length > size:
            raise _fail(where, index.fqn, f"claims bytes {offset}..{offset + length} of '{name}', which has {size}")
        bounds[(index.fqn, index.offset)] = None if descriptors else length
    return sizes, bounds


def _is_shape(value: Any) -> bool:
    if type(value) is torch.Size:  # its elements are ints by construction
        return not value or min(value) >= 0
    return isinstance(value, (tuple, list)) and all(type(n) is int and n >= 0 for n in value)


def _check_tensor(fqn: str, md: TensorStorageMetadata, bounds: dict[tuple[str, Any], int | None], where: str) -> None:
    size: Any = md.size  # untrusted: _is_shape checks it
    chunks = md.chunks
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not _is_shape(size) or not isinstance(dtype, torch.dtype) or not isinstance(chunks, list):
        raise _fail(where, fqn, "has a malformed size, dtype or chunk list")
    size = tuple(size)
    if len(chunks) == 1:  # most tensors: one chunk, the whole tensor
        chunk = chunks[0]
        if (
            type(chunk) is ChunkStorageMetadata
            and type(chunk.sizes) is torch.Size  # ints by construction, as _is_shape asks
            and type(chunk.offsets) is torch.Size
            and chunk.sizes == size
            and not any(chunk.offsets)
        ):
            offsets = tuple(chunk.offsets)
            if len(offsets) == len(size):
                _check_bound(fqn, offsets, math.prod(size), dtype, bounds, where)
                return
    rank, numel = len(size), math.prod(size)
    total = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not _is_shape(chunk.offsets) or not _is_shape(chunk.sizes):
            raise _fail(where, fqn, "has a malformed chunk")
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != rank or len(sizes) != rank or not all(map(le, map(add, offsets, sizes), size)):
            raise _fail(where, fqn, f"has a chunk at {offsets} of {sizes} outside its size {size}")
        volume = math.prod(sizes)
        _check_bound(fqn, offsets, volume, dtype, bounds, where)
        total += volume
        if volume:
            boxes.append((offsets, sizes))
    if total != numel or _overlap(boxes):
        raise _fail(where, fqn, f"has chunks that do not cover its size {size} exactly ({total} of {numel} elements, gaps or overlaps)")


def _check_bound(fqn: str, offsets: tuple[int, ...], volume: int, dtype: torch.dtype, bounds: dict[tuple[str, Any], int | None], where: str) -> None:
    """The chunk at ``offsets`` has a storage entry whose bytes can hold it."""
    key = (fqn, offsets)
    if key not in bounds:
        raise _fail(where, fqn, f"has no storage entry for its chunk at {offsets}")
    length = bounds[key]
    if length is not None and volume * dtype.itemsize > length:
        raise _fail(where, fqn, f"claims {volume} elements at {offsets} in an item of {length} bytes")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two boxes intersect (a sweep along the first dimension)."""
    if len(boxes) < 2 or not boxes[0][0]:
        return len(boxes) > 1
    boxes = sorted(boxes)
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in boxes:
        start = box[0][0]
        active = [other for other in active if other[0][0] + other[1][0] > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])):
                return True
        active.append(box)
    return False
