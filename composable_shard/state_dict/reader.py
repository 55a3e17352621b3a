"""Owns: ``DirectFileSystemReader``, a ``torch.distributed.checkpoint``
storage reader for checkpoint directories on a local file system that reads
each tensor item straight into its destination (one copy from the page
cache, no temporary tensor), with the same results as the stock
``FileSystemReader``. See [Note: direct reads].

Knows nothing of: models, optimizers, our manifest or checksums (it reads
any DCP directory that ``FileSystemWriter`` wrote); the planner's state dict
(it goes through ``planner.resolve_tensor`` / ``commit_tensor`` /
``load_bytes`` as the stock reader does).

Public names: ``DirectFileSystemReader``.

[Note: direct reads]
The stock ``FileSystemReader.read_data`` calls ``torch.load`` on each
item's slice of its file: that allocates a new tensor of the saved chunk,
parses the zip archive ``torch.save`` wrote, copies the bytes out of the
page cache into it, and then ``copy_``s the requested narrow of it into the
destination (two copies, plus page faults on the new allocation).

An item written by ``torch.save`` of one tensor is a zip archive of stored
(uncompressed) records: ``<prefix>/data.pkl``, a small pickle that rebuilds
the tensor from a storage with ``torch._utils._rebuild_tensor_v2(storage,
storage_offset, size, stride, ...)``; ``<prefix>/byteorder``; and the raw
bytes of the storage as ``<prefix>/data/<key>``, among others. The records
are streamed (their local headers carry no sizes), so this reader reads the
archive's central directory from the item's last few KiB (zip64 records
included), then the local headers of the three records it needs; it
unpickles ``data.pkl`` with an unpickler that knows nothing but those few
names (it builds a description, never a tensor, and refuses anything else),
and so learns the saved tensor's dtype, storage offset, size and stride and
where its raw bytes start in the file. Then, per read item (the requested
box of that saved tensor):

- its bytes are one contiguous range of the file and the destination
  (``planner.resolve_tensor``) is a contiguous CPU tensor of the same dtype:
  read the range straight into the destination's memory (``readinto``);
- otherwise (a box that narrows inner dimensions, a non-contiguous or
  non-CPU destination): read the span of the file the box covers into one
  temporary tensor and ``copy_`` the box's view of it;
- anything unexpected (a transform such as compression named in the item's
  metadata, another serialization, an unknown pickle, a dtype or size that
  differs from the destination, a byte-order other than this machine's):
  the stock ``read_data`` reads that item (with
  ``torch.load(weights_only=True)``).

Bytes items (objects) are found and untransformed by the stock
``read_data``, but unpickled here as data (``load_object``; see [Note:
checkpoints are data] in safe_pickle.py), all of them, and a tensor item
whose pickle names a global beyond a tensor's is checked the same way,
before any value is handed to the planner: a refused read changes nothing
on this rank. (A tensor item is read only by the ranks whose boxes need it,
so only they refuse it; bytes items are read by every rank that loads
them.) A malformed item (a zip structure that does not parse) raises
``CheckpointError`` naming the file and item.

So every destination holds what the stock reader would have written (the
same bytes; the tests compare them bit for bit) and ``commit_tensor`` is
called once per tensor item as there. A truncated file raises ``OSError``
naming it. Like ``torch.load``, neither reader checks the zip records'
CRC-32: a checkpoint whose bytes may be damaged must be verified first
(``load_checkpoint`` does, against its manifest).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .files import CheckpointError
from .safe_pickle import (
    HOW_TO_ADMIT,
    PickleTrust,
    UnsafeCheckpointError,
    UnsafeTensorItemError,
    admitted_globals,
    load_metadata,
    load_object,
    unsafe_globals_in,
)

__all__ = ["DirectFileSystemReader"]

logger = logging.getLogger(__name__)

# The storage classes torch.save names in data.pkl, by name (the classes
# themselves warn when touched), to their dtypes.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # zip central directory entry, 46 bytes
_CENTRAL_SIGNATURE = 0x02014B50
_END = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_END_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_ZIP64_LOCATOR_SIGNATURE = 0x07064B50
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
_ZIP64_END_SIGNATURE = 0x06064B50
_ZIP64_EXTRA = 0x0001
_MASK32 = 0xFFFFFFFF
_TAIL_BYTES = 4096  # read at once from an item's end: the central directory of one tensor's archive, usually
_MAX_PICKLE_BYTES = 1 << 20  # a data.pkl of one tensor is a few hundred bytes


class _Unsupported(Exception):
    """This item is not one this reader reads itself; the stock reader will."""

    def __init__(self, why: str, *, wants_global: bool = False) -> None:
        super().__init__(why)
        # Its pickle names a global beyond a plain tensor's (see _refuse_unsafe_item).
        self.wants_global = wants_global


@dataclasses.dataclass(frozen=True)
class _SavedTensor:
    """What ``torch.save`` of one tensor stored: the storage's dtype, its
    record key and length in elements, and the tensor's view of it."""

    dtype: torch.dtype
    key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _SavedItem:
    """A saved tensor and where its storage's bytes start in the file."""

    tensor: _SavedTensor
    data_start: int  # absolute file offset of the storage's first byte


@dataclasses.dataclass(frozen=True)
class _Persistent:
    dtype: torch.dtype
    key: str
    numel: int


def _describe_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any, metadata: Any = None
) -> _SavedTensor:
    """Stands in for ``torch._utils._rebuild_tensor_v2`` in our unpickler."""
    if not isinstance(storage, _Persistent) or backward_hooks or metadata:
        raise _Unsupported("a tensor with hooks or metadata")
    if not isinstance(storage_offset, int) or not isinstance(size, tuple) or not isinstance(stride, tuple):
        raise _Unsupported("an unexpected tensor description")
    if len(size) != len(stride) or not all(isinstance(v, int) and v >= 0 for v in size + stride):
        raise _Unsupported("an unexpected tensor description")
    return _SavedTensor(storage.dtype, storage.key, storage.numel, storage_offset, size, stride)


class _Hooks(dict):
    """Stands in for ``collections.OrderedDict`` (the empty backward hooks)."""


class _TensorDescriptionUnpickler(pickle.Unpickler):
    """Unpickles the data.pkl of ``torch.save(tensor)`` into a
    ``_SavedTensor``; any other name raises ``_Unsupported``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _describe_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return _Hooks
        if module == "torch" and name in _STORAGE_DTYPES:
            return name  # the persistent id names its storage class; see persistent_load
        raise _Unsupported(f"pickle global {module}.{name}", wants_global=True)

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise _Unsupported("an unexpected persistent id")
        _, storage_type, key, location, numel = pid
        if storage_type not in _STORAGE_DTYPES or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise _Unsupported("an unexpected storage")
        return _Persistent(_STORAGE_DTYPES[storage_type], key, numel)


def _describe(data: bytes) -> _SavedTensor:
    try:
        result = _TensorDescriptionUnpickler(io.BytesIO(data)).load()
    except (_Unsupported, UnsafeCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle: let the stock reader say what it is
        raise _Unsupported(f"an unreadable pickle ({type(exc).__name__})") from exc
    if not isinstance(result, _SavedTensor):
        raise _Unsupported("a pickle of something other than one tensor")
    return result


def _pread(stream: BinaryIO, offset: int, length: int) -> bytes:
    stream.seek(offset)
    return stream.read(length)


def _records(stream: BinaryIO, start: int, length: int) -> dict[str, tuple[int, int]]:
    """The zip records of the item at ``[start, start + length)``: name ->
    (offset of its local header in the item, its size), from the archive's
    central directory (``torch.save`` streams its records, so their local
    headers carry no sizes)."""
    tail_start = max(0, length - _TAIL_BYTES)
    tail = _pread(stream, start + tail_start, length - tail_start)
    end = tail.rfind(_END_SIGNATURE)
    if end < 0 or end + _END.size > len(tail):
        raise _Unsupported("not a zip archive (another serialization)")
    _, _, _, _, entries, directory_size, directory_offset, _ = _END.unpack_from(tail, end)
    locator_at = end - _ZIP64_LOCATOR.size
    # torch.save writes the zip64 end records whatever the size; its values
    # are the ones that hold past 4 GiB.
    if locator_at >= 0 and _ZIP64_LOCATOR.unpack_from(tail, locator_at)[0] == _ZIP64_LOCATOR_SIGNATURE:
        zip64_end = _ZIP64_LOCATOR.unpack_from(tail, locator_at)[2]
        fields = _ZIP64_END.unpack(_exact(stream, start, zip64_end, _ZIP64_END.size, length))
        if fields[0] != _ZIP64_END_SIGNATURE:
            raise _Unsupported("a damaged zip64 end record")
        entries, directory_size, directory_offset = fields[7], fields[8], fields[9]
    elif _MASK32 in (directory_offset, directory_size) or entries == 0xFFFF:
        raise _Unsupported("a zip64 archive without its locator")
    if directory_size > 1 << 20:
        raise _Unsupported("a large zip directory")
    if tail_start <= directory_offset and directory_offset + directory_size <= length:
        directory = tail[directory_offset - tail_start : directory_offset - tail_start + directory_size]
    else:
        directory = _exact(stream, start, directory_offset, directory_size, length)
    central: dict[str, tuple[int, int]] = {}  # name -> (local header offset, size)
    position = 0
    for _ in range(entries):
        if position + _CENTRAL_HEADER.size > len(directory):
            raise _Unsupported("a truncated zip directory")
        fields = _CENTRAL_HEADER.unpack_from(directory, position)
        signature, method, compressed, uncompressed = fields[0], fields[4], fields[8], fields[9]
        name_length, extra_length, comment_length, local_offset = fields[10], fields[11], fields[12], fields[16]
        if signature != _CENTRAL_SIGNATURE or method != 0:
            raise _Unsupported("a compressed or damaged zip record")
        name_at = position + _CENTRAL_HEADER.size
        name = directory[name_at : name_at + name_length].decode("utf-8", "replace")
        extra = directory[name_at + name_length : name_at + name_length + extra_length]
        if _MASK32 in (compressed, uncompressed, local_offset):
            uncompressed, compressed, local_offset = _zip64_values(extra, uncompressed, compressed, local_offset)
        if compressed != uncompressed:
            raise _Unsupported("a zip record whose sizes differ")
        central[name] = (local_offset, compressed)
        position = name_at + name_length + extra_length + comment_length
    return central


def _exact(stream: BinaryIO, start: int, offset: int, count: int, length: int) -> bytes:
    """``count`` bytes at ``offset`` of the item (which has ``length``)."""
    if offset < 0 or offset + count > length:
        raise _Unsupported("a zip structure past the item's end")
    data = _pread(stream, start + offset, count)
    if len(data) != count:
        raise _Unsupported("a truncated item")
    return data


def _data_offset(stream: BinaryIO, start: int, local_offset: int, length: int) -> int:
    """Where the data of the record whose local header is at
    ``local_offset`` begins, relative to the item's start."""
    header = _LOCAL_HEADER.unpack(_exact(stream, start, local_offset, _LOCAL_HEADER.size, length))
    if header[0] != _LOCAL_SIGNATURE:
        raise _Unsupported("a damaged zip record")
    return local_offset + _LOCAL_HEADER.size + header[9] + header[10]


def _zip64_values(extra: bytes, uncompressed: int, compressed: int, local_offset: int) -> tuple[int, int, int]:
    """The 64-bit values a central directory entry's zip64 extra field
    holds for those of its fields that are 0xFFFFFFFF, in the zip order."""
    position = 0
    while position + 4 <= len(extra):
        header_id, size = struct.unpack_from("<HH", extra, position)
        if header_id == _ZIP64_EXTRA:
            values = [v for v in (uncompressed, compressed, local_offset) if v == _MASK32]
            if size < 8 * len(values):
                break
            found = iter(struct.unpack_from(f"<{len(values)}Q", extra, position + 4))
            uncompressed = next(found) if uncompressed == _MASK32 else uncompressed
            compressed = next(found) if compressed == _MASK32 else compressed
            local_offset = next(found) if local_offset == _MASK32 else local_offset
            return uncompressed, compressed, local_offset
        position += 4 + size
    raise _Unsupported("a zip64 record without its sizes")


def _parse_item(stream: BinaryIO, offset: int, length: int) -> _SavedItem:
    records = _records(stream, offset, length)

    def data(name: str) -> tuple[int, int]:  # (absolute file offset, size)
        local, size = records[name]
        start = _data_offset(stream, offset, local, length)
        if start + size > length:
            raise _Unsupported("a zip record past the item's end")
        return offset + start, size

    pickles = [name for name in records if name.endswith("/data.pkl") or name == "data.pkl"]
    if len(pickles) != 1:
        raise _Unsupported("no data.pkl record")
    prefix = pickles[0][: -len("data.pkl")]
    pickle_start, pickle_size = data(pickles[0])
    if pickle_size > _MAX_PICKLE_BYTES:
        raise _Unsupported("a large pickle")
    saved = _describe(_pread(stream, pickle_start, pickle_size))
    if prefix + "byteorder" in records:
        if _pread(stream, *data(prefix + "byteorder")).decode("ascii", "replace") != sys.byteorder:
            raise _Unsupported("another byte order")
    elif sys.byteorder != "little":
        raise _Unsupported("a checkpoint of unknown byte order")
    storage = f"{prefix}data/{saved.key}"
    if storage not in records:
        raise _Unsupported("no record of the storage")
    data_start, data_size = data(storage)
    if data_size != saved.storage_numel * _itemsize(saved.dtype):
        raise _Unsupported("a storage record of another size")
    return _SavedItem(saved, data_start)


class _ItemView(io.RawIOBase):
    """The bytes ``[start, start + length)`` of a file, as a seekable
    read-only file (for torch's zip reader)."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._stream, self._start, self._length, self._position = stream, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), self._length - self._position))
        data = _pread(self._stream, self._start + self._position, count)
        target[: len(data)] = data
        self._position += len(data)
        return len(data)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


def _read_exactly(stream: BinaryIO, offset: int, target: memoryview, path: str) -> None:
    """Fill ``target`` with the file's bytes from ``offset`` on."""
    stream.seek(offset)
    done, total = 0, len(target)
    while done < total:
        count = stream.readinto(target[done:])
        if not count:
            raise OSError(
                f"composable_shard DirectFileSystemReader: '{path}' ends at byte {offset + done}, before the "
                f"{total} bytes its checkpoint metadata places at {offset} (a truncated file; load another checkpoint)"
            )
        done += count


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The writable memory of a contiguous CPU tensor."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclasses.dataclass
class _RefusedMetadata(Metadata):
    """Stands for a ``.metadata`` this reader refused, so that ``dcp.load``
    raises the refusal. See [Note: a refused .metadata reaches dcp.load's
    caller]."""

    refusal: CheckpointError | None = None


# [Note: a refused .metadata reaches dcp.load's caller]
# ``dcp.load`` (torch 2.11 and later) catches any exception from
# ``read_metadata()`` and, as our ``read_metadata`` takes keyword arguments,
# falls back to the rank-local ``read_metadata(rank=r)``; torch 2.11 then
# drops both exceptions and fails with its own "metadata is None", which
# hides that the checkpoint was refused as unsafe. So once ``.metadata`` is
# refused, ``read_metadata(rank=r)`` answers an empty ``_RefusedMetadata``
# carrying the refusal (a refused checkpoint is refused whatever rank-local
# files it has), and ``set_up_storage_reader``, which ``dcp.load`` calls
# next on every rank, raises that refusal: DCP's ``CheckpointException``
# then carries our ``UnsafeCheckpointError`` from every rank, as on torch
# versions that let the first exception through. A successful read of
# ``.metadata`` forgets the refusal.


class DirectFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads tensor items straight into their
    destinations, with the same results, and reads the checkpoint's pickles
    as data: ``.metadata`` and every bytes item refuse any global beyond
    plain data with ``UnsafeCheckpointError`` (a ``CheckpointError``), before
    any tensor is read. See [Note: direct reads] and [Note: checkpoints are
    data] (safe_pickle.py).

    Use it as any storage reader: ``dcp.load(state_dict,
    storage_reader=DirectFileSystemReader(path))``. ``safe_globals`` admits
    more types (as ``torch.serialization.add_safe_globals``, which is
    honoured too); ``trusted=True`` reads the pickles unrestricted, for a
    checkpoint you trust. ``counts`` says how its items were read so far:
    ``"direct"`` (into the destination), ``"temporary"`` (through one
    temporary tensor) and ``"stock"`` (by ``FileSystemReader.read_data``,
    bytes items included: it finds their bytes, they are then read here as
    data)."""

    def __init__(
        self, path: str | os.PathLike[str], *args: Any, trusted: bool = False, safe_globals: Sequence[Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.trust = PickleTrust.of(trusted, safe_globals)
        self.counts: dict[str, int] = {"direct": 0, "temporary": 0, "stock": 0}
        self._refused: CheckpointError | None = None  # the last refusal of ``.metadata``

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trust.trusted:
            return super().read_metadata(*args, **kwargs)
        rank = kwargs.get("rank")
        if rank is not None and self._refused is not None:
            # See [Note: a refused .metadata reaches dcp.load's caller].
            return _RefusedMetadata(state_dict_metadata={}, refusal=self._refused)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            metadata = load_metadata(os.fspath(self.fs.concat_path(self.path, name)), self.trust)
        except CheckpointError as refused:
            if rank is None:
                self._refused = refused
            raise
        if rank is None:
            self._refused = None
        load_id = getattr(self, "load_id", None)
        if load_id is not None and hasattr(metadata, "storage_meta"):  # as the stock reader does
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, _RefusedMetadata) and metadata.refusal is not None:
            raise metadata.refusal
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Everything that can refuse the checkpoint runs before anything is
        # handed to the planner: a refused load changes nothing.
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        parsed = {relative_path: self._parse_items(relative_path, items) for relative_path, items in per_file.items()}
        objects = dataclasses.replace(plan, items=[item for item in plan.items if item.type == LoadItemType.BYTE_IO])
        if objects.items:
            self._read_objects(objects, planner)
        pending: list[ReadItem] = []  # for the stock reader, in plan order
        for relative_path, items in per_file.items():
            path = os.fspath(self.fs.concat_path(self.path, relative_path))
            with open(path, "rb", buffering=0) as stream:
                for item in items:
                    how = self._read_checked_item(stream, path, item, planner, parsed[relative_path])
                    if how is None:
                        pending.append(item)
                    else:
                        self.counts[how] += 1
        if pending:
            self._read_stock(dataclasses.replace(plan, items=pending), planner)
        logger.debug("DirectFileSystemReader: items read so far: %s", self.counts)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _parse_items(self, relative_path: str, items: list[ReadItem]) -> dict[tuple[int, int], _SavedItem | None]:
        """Each tensor item's description (None: the stock reader reads
        it), reading only the zip directories and pickles. Refuses an item
        whose pickle wants a global ``torch.load(weights_only=True)`` would
        refuse, before any item is read."""
        path = os.fspath(self.fs.concat_path(self.path, relative_path))
        parsed: dict[tuple[int, int], _SavedItem | None] = {}
        with open(path, "rb", buffering=0) as stream:
            for item in items:
                info = self.storage_data[item.storage_index]
                where = (info.offset, info.length)
                if where in parsed or getattr(info, "transform_descriptors", None):
                    continue
                try:
                    parsed[where] = _parse_item(stream, info.offset, info.length)
                except _Unsupported as why:
                    logger.debug("DirectFileSystemReader: %s in %s at %d: stock reader", why, path, info.offset)
                    parsed[where] = None
                    if why.wants_global and not self.trust.trusted:
                        self._refuse_unsafe_item(stream, path, item)
                except (struct.error, ValueError, OverflowError, IndexError, RuntimeError) as exc:
                    if isinstance(exc, CheckpointError):
                        raise
                    raise self._malformed(path, item, exc) from exc
        return parsed

    def _refuse_unsafe_item(self, stream: BinaryIO, path: str, item: ReadItem) -> None:
        """Raise ``UnsafeCheckpointError`` if the tensor item's pickle names
        a global that ``torch.load(weights_only=True)`` does not admit
        (where this torch can tell without unpickling; else the stock
        read refuses it, see ``_read_stock``)."""
        info = self.storage_data[item.storage_index]
        with admitted_globals(self.trust):
            unsafe = unsafe_globals_in(_ItemView(stream, info.offset, info.length))
        if unsafe:
            raise UnsafeTensorItemError(
                f"'{path}': the tensor item '{item.storage_index.fqn}' wants {', '.join(unsafe)}, which a tensor does "
                f"not need; refused before this rank read any tensor. {HOW_TO_ADMIT}."
            )

    def _read_stock(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """The stock reader's read of ``plan``'s tensor items (it loads each
        with ``torch.load(weights_only=True)``)."""
        try:
            super().read_data(plan, planner).wait()
        except pickle.UnpicklingError as exc:
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            raise UnsafeTensorItemError(
                f"DirectFileSystemReader({self.path}): a tensor item in {files} was refused by "
                f"torch.load(weights_only=True) ({' '.join(str(exc).split())[-200:]}). {HOW_TO_ADMIT}."
            ) from None
        self.counts["stock"] += len(plan.items)

    def _read_objects(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every bytes item of ``plan`` as data (the stock reader finds
        and untransforms their bytes), then hand them all to ``planner``."""
        if self.trust.trusted:
            super().read_data(plan, planner).wait()
        else:
            checked = _CheckedObjects(self.trust, os.fspath(self.path), self.storage_data)
            super().read_data(plan, checked).wait()  # type: ignore[arg-type]  # the stock reader calls only load_bytes
            for item, value in checked.values:
                _deliver(planner, item, value)
        self.counts["stock"] += len(plan.items)

    def _read_checked_item(
        self,
        stream: BinaryIO,
        path: str,
        item: ReadItem,
        planner: LoadPlanner,
        parsed: dict[tuple[int, int], _SavedItem | None],
    ) -> str | None:
        """``_read_item``, with a malformed item's low-level error said as
        a ``CheckpointError`` naming the file and item."""
        try:
            return self._read_item(stream, path, item, planner, parsed)
        except CheckpointError:
            raise
        except (struct.error, RuntimeError, ValueError, OverflowError, IndexError) as exc:
            raise self._malformed(path, item, exc) from exc

    def _malformed(self, path: str, item: ReadItem, exc: BaseException) -> CheckpointError:
        return CheckpointError(
            f"DirectFileSystemReader: '{path}': the item '{item.storage_index.fqn}' at offset "
            f"{self.storage_data[item.storage_index].offset} is malformed ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}). The checkpoint is damaged; load another one."
        )

    def _read_item(
        self,
        stream: BinaryIO,
        path: str,
        item: ReadItem,
        planner: LoadPlanner,
        parsed: dict[tuple[int, int], _SavedItem | None],
    ) -> str | None:
        """Read one item (described in ``parsed``) into its destination and
        say how (a ``counts`` key); None (nothing done) when the stock reader
        must read it."""
        info = self.storage_data[item.storage_index]
        saved = parsed.get((info.offset, info.length))
        if saved is None:
            return None
        target = planner.resolve_tensor(item).detach()
        box = _box(saved.tensor, tuple(item.storage_offsets), tuple(item.lengths))
        if (
            box is None
            or type(target) is not torch.Tensor
            or target.dtype != saved.tensor.dtype
            or tuple(target.size()) != tuple(item.lengths)
            or target.is_conj()
            or target.is_neg()
        ):
            return None
        first, span, contiguous = box
        start = saved.data_start + first * target.element_size()
        how = "direct"
        if target.numel() == 0:
            pass
        elif contiguous and target.device.type == "cpu" and target.is_contiguous():
            _read_exactly(stream, start, _bytes_of(target), path)
        else:
            how = "temporary"
            temporary = torch.empty(span, dtype=target.dtype)
            _read_exactly(stream, start, _bytes_of(temporary), path)
            target.copy_(temporary.as_strided(tuple(item.lengths), saved.tensor.stride, 0))
        planner.commit_tensor(item, target)
        return how


class _CheckedObjects:
    """Stands in for the planner while the stock reader reads bytes items:
    each is loaded as data (``load_object``) and kept, so that all are
    checked before any reaches the planner."""

    def __init__(self, trust: PickleTrust, root: str, storage_data: dict[Any, Any]) -> None:
        self._trust = trust
        self._root = root
        self._storage_data = storage_data
        # (read item, the object it holds), in read order.
        self.values: list[tuple[ReadItem, Any]] = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        file = os.path.join(self._root, self._storage_data[read_item.storage_index].relative_path)
        self.values.append((read_item, load_object(value.getvalue(), self._trust, file=file, item=read_item.dest_index.fqn)))


def _deliver(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand an object read as data to ``planner``: into its state dict where
    it is DCP's default planner (its ``load_bytes`` would unpickle it again,
    unrestricted), else through ``load_bytes`` of a fresh ``torch.save`` of
    the checked object (whatever that planner does with it runs only on
    what we built)."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes and _set_in_default_planner(planner, item, value):
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)


def _set_in_default_planner(planner: Any, item: ReadItem, value: Any) -> bool:
    """Put ``value`` where ``DefaultLoadPlanner.load_bytes`` puts it (the
    place must exist, as it does in the state dict being loaded); False
    where it does not."""
    fqn = item.dest_index.fqn
    try:
        if getattr(planner, "flatten_state_dict", False):
            *parents, last = planner.mappings[fqn]
            node = planner.original_state_dict
            for key in parents:
                node = node[key]
            if not isinstance(node, (dict, list)):
                return False
            node[last] = value
        else:
            planner.state_dict[fqn] = value
    except (KeyError, IndexError, TypeError, AttributeError):
        return False
    return True


def _box(saved: _SavedTensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int, bool] | None:
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
    numel = 1
    for n in lengths:
        numel *= n
    return first, span, _is_contiguous(lengths, saved.stride) and span == numel
