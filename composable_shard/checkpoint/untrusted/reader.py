"""Owns: ``DirectFileSystemReader``, a ``torch.distributed.checkpoint``
storage reader for checkpoint directories on a local file system that reads
each tensor item straight into its destination, with the same results as
the stock ``FileSystemReader``, and every pickle of the checkpoint as data.

Knows nothing of: models, optimizers, our manifest or checksums (it reads
any DCP directory that ``FileSystemWriter`` wrote); the planner's state dict
(it goes through ``planner.resolve_tensor`` / ``commit_tensor`` /
``load_bytes`` as the stock reader does).

[Note: direct reads]
The stock ``read_data`` ``torch.load``s each item into a new tensor and
``copy_``s the requested narrow of it into the destination (two copies).
This reader describes each tensor item without reading its bytes
(saved_tensor.py), then per read item:

- the box's bytes are one range of the file and the destination is a
  contiguous CPU tensor of the saved dtype: ``readinto`` the destination;
- another box or destination: read the span into one temporary, ``copy_``;
- anything else (a transform named in the item's metadata, another
  serialization, a pickle of more than a plain tensor, another dtype or
  byte order): the item is loaded whole with ``torch.load(weights_only=True)``
  into a temporary, as the stock ``read_data`` does, before any write.

Bytes items are read as data (safe_pickle.py) and everything is checked
before anything is written (see [Note: everything checked before the first
write]); a zip that torch's reader cannot parse is a ``CheckpointError``
naming the file and item. Neither reader checks the zip CRCs: ``load_checkpoint`` verifies
the files against the manifest first. Pinned by tests/checkpoint/test_reader.py
(bit for bit against the stock reader) and tests/checkpoint/test_pickles.py.

[Note: everything checked before the first write]
``read_data`` runs in two phases. ``_check_and_stage`` writes nothing into a
destination: it opens each file (inside the directory, regular, sized:
safe_files.py), checks each item's byte range against the file, describes
each tensor item and checks its dtype, shape and layout against the
metadata (``.metadata`` itself was checked by metadata_checks.py: chunks
cover each tensor exactly, ranges lie inside the files), reads every bytes
item as data and reads the items the direct path cannot (legacy format,
transforms, other dtypes) into temporaries — every pickle bounded first
(pickle_bounds.py). With ``agree_before_writing`` (``load_checkpoint``) the
ranks then agree on a refusal (refusals.py), so every rank raises the same
one. Only then ``_write`` hands objects to the planner and reads into the
destinations. Pinned by tests/checkpoint/test_hostile.py and
tests/checkpoint/test_fuzz.py.

[Note: a refused .metadata reaches dcp.load's caller]
``dcp.load`` (torch 2.11+) catches an exception from ``read_metadata()``,
retries the rank-local ``read_metadata(rank=r)`` and then fails with its
own "metadata is None", hiding the refusal. So after a refused ``.metadata``
the rank-local call answers an empty ``_RefusedMetadata`` carrying the
refusal, which ``set_up_storage_reader`` raises on every rank. Pinned by
tests/checkpoint/test_pickles.py.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from typing import Any, BinaryIO, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future


from ..errors import CheckpointError, UnsafeTensorItemError
from .metadata_checks import check_metadata, check_metadata_once
from .pickle_bounds import check_saved_pickles
from ..refusals import agree_on_refusal
from .safe_files import open_regular, resolve_inside
from .safe_pickle import (
    HOW_TO_ADMIT,
    PickleTrust,
    admitted_globals,
    load_metadata,
    load_object,
    read_metadata_bytes,
    unsafe_globals_in,
)
from .saved_tensor import ItemView, NotDescribed, SavedTensor, box_span, describe_item, layout_problem

__all__ = ["DirectFileSystemReader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _RefusedMetadata(Metadata):
    """Stands for a ``.metadata`` this reader refused (see [Note: a refused
    .metadata reaches dcp.load's caller])."""

    refusal: CheckpointError | None = None


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
    data).

    Every file the metadata names must lie inside ``path`` as a regular
    file (``allow_links_outside=True`` follows symbolic links leading out);
    every item is checked before the first write (see [Note: everything
    checked before the first write]); with ``agree_before_writing=True``
    (every rank of the default group loads) the ranks agree on a refusal
    first, so all raise the same one and none writes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        trusted: bool = False,
        safe_globals: Sequence[Any] | None = None,
        allow_links_outside: bool = False,
        agree_before_writing: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.trust = PickleTrust.of(trusted, safe_globals)
        self.allow_links_outside = bool(allow_links_outside)
        self.agree_before_writing = bool(agree_before_writing)
        self._entries: dict[str, Any] = {}  # the metadata's state_dict_metadata, once set up
        self.counts: dict[str, int] = {"direct": 0, "temporary": 0, "stock": 0}
        self._refused: CheckpointError | None = None  # the last refusal of ``.metadata``

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None and self._refused is not None:
            # See [Note: a refused .metadata reaches dcp.load's caller].
            return _RefusedMetadata(state_dict_metadata={}, refusal=self._refused)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            where = os.path.join(os.fspath(self.path), name)
            real = resolve_inside(self.path, name, f"DirectFileSystemReader({self.path})", allow_links_outside=self.allow_links_outside)
            content = read_metadata_bytes(real)
            metadata = load_metadata(real, self.trust, content)
            if self.trust.trusted:  # unrestricted unpickling: the objects are not a function of the bytes
                check_metadata(metadata, where, self.path, allow_links_outside=self.allow_links_outside)
            else:  # load_checkpoint reads it twice: see [Note: a metadata verdict kept]
                reading = (self.trust, tuple(torch.serialization.get_safe_globals()))
                check_metadata_once(metadata, content, reading, where, self.path, allow_links_outside=self.allow_links_outside)
        except CheckpointError as refused:
            refused.before_writing = True  # type: ignore[attr-defined]
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
        self._entries = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # See [Note: everything checked before the first write].
        staged: _Staged | None = None
        refusal: CheckpointError | None = None
        try:
            staged = self._check_and_stage(plan, planner)
        except CheckpointError as exc:
            exc.before_writing = True  # type: ignore[attr-defined]
            refusal = exc
        if self.agree_before_writing:
            refusal = agree_on_refusal(refusal)
        try:
            if refusal is not None:
                raise refusal
            assert staged is not None
            self._write(staged, planner)
        finally:
            if staged is not None:
                staged.close()
        logger.debug("DirectFileSystemReader: items read so far: %s", self.counts)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open(self, relative_path: str, fqn: str) -> tuple[str, BinaryIO, int]:
        where = f"DirectFileSystemReader({self.path}): the item '{fqn}'"
        real = resolve_inside(self.path, relative_path, where, allow_links_outside=self.allow_links_outside)
        stream, size = open_regular(real, where)
        return os.fspath(real), stream, size

    def _check_and_stage(self, plan: LoadPlan, planner: LoadPlanner) -> "_Staged":
        """Everything that can refuse the checkpoint, with no write into a
        destination: each file opened and sized, each item's byte range,
        header, dtype, shape and layout checked against the metadata, each
        pickle read as data; items the direct path cannot read are read into
        temporaries here."""
        staged = _Staged()
        try:
            per_file: dict[str, list[ReadItem]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, items in per_file.items():
                path, stream, size = self._open(relative_path, items[0].storage_index.fqn)
                staged.files[relative_path] = (path, stream)
                parsed: dict[tuple[int, int], SavedTensor | None] = {}
                for item in items:
                    info = self.storage_data[item.storage_index]
                    if info.offset + info.length > size:
                        raise self._malformed(path, item, f"its bytes {info.offset}..{info.offset + info.length} lie past the file's {size}")
                    if item.type == LoadItemType.BYTE_IO:
                        data = self._item_bytes(stream, path, item)
                        value = load_object(data, self.trust, file=path, item=item.dest_index.fqn)
                        staged.objects.append((item, value))
                        continue
                    saved = self._describe(stream, path, item, info, parsed)
                    target = planner.resolve_tensor(item).detach()
                    if tuple(target.size()) != tuple(item.lengths):
                        raise self._malformed(path, item, f"its destination has size {tuple(target.size())}, not {tuple(item.lengths)}")
                    if saved is None:
                        staged.temporaries.append((item, self._load_whole(stream, path, item)))
                        continue
                    box = box_span(saved, tuple(item.storage_offsets), tuple(item.lengths))
                    if box is None:
                        raise self._malformed(path, item, "the requested box does not fit the stored tensor")
                    if self._needs_stock(target, saved):
                        staged.temporaries.append((item, self._load_whole(stream, path, item)))
                    else:
                        staged.direct.append((relative_path, item, saved, box, target))
        except BaseException:
            staged.close()
            raise
        return staged

    def _expected(self, item: ReadItem) -> tuple[tuple[int, ...], torch.dtype | None]:
        """The stored chunk's size and dtype, as the metadata says (``()``
        and None where it names no such chunk). Looked up per item read, not
        tabled for the whole checkpoint (a rank reads about half of it):
        DCP's read items carry the chunk's index in ``md.chunks``."""
        index = item.storage_index
        md = self._entries.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return (), None
        offset, chunks, hint = tuple(index.offset or ()), md.chunks, index.index
        if type(hint) is int and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offset:
            return tuple(chunks[hint].sizes), md.properties.dtype
        found = [chunk for chunk in chunks if tuple(chunk.offsets) == offset]
        return (tuple(found[-1].sizes) if found else ()), md.properties.dtype

    def _describe(
        self, stream: BinaryIO, path: str, item: ReadItem, info: Any, parsed: dict[tuple[int, int], SavedTensor | None]
    ) -> SavedTensor | None:
        where = (info.offset, info.length)
        if where in parsed:
            return parsed[where]
        saved: SavedTensor | None = None
        if not getattr(info, "transform_descriptors", None):
            view = ItemView(stream, info.offset, info.length)
            try:
                with admitted_globals(self.trust):
                    saved = describe_item(view)
            except NotDescribed as why:
                logger.debug("DirectFileSystemReader: %s in %s at %d: stock reader", why, path, info.offset)
                if why.wants_global and not self.trust.trusted:
                    self._refuse_unsafe_item(view, path, item)
            except CheckpointError as exc:
                raise self._malformed(path, item, str(exc)) from None
            except (ValueError, OverflowError, IndexError, RuntimeError, TypeError, EOFError) as exc:
                raise self._malformed(path, item, exc) from None
        if saved is not None:
            self._check_stored(path, item, saved.size, saved.dtype, saved.stride, saved.storage_offset, saved.storage_numel)
        parsed[where] = saved
        return saved

    def _check_stored(self, path: str, item: ReadItem, size: tuple[int, ...], dtype: torch.dtype, stride: tuple[int, ...], storage_offset: int, storage_numel: int) -> None:
        sizes, expected_dtype = self._expected(item)
        if self._entries and (tuple(size) != sizes or dtype != expected_dtype):
            raise self._malformed(path, item, f"it stores {dtype} of size {tuple(size)}; the metadata says {expected_dtype} of size {sizes}")
        problem = layout_problem(tuple(size), tuple(stride), storage_offset, storage_numel)
        if problem is not None:
            raise self._malformed(path, item, f"it stores {problem}")

    @staticmethod
    def _needs_stock(target: torch.Tensor, saved: SavedTensor) -> bool:
        return type(target) is not torch.Tensor or target.dtype != saved.dtype or target.is_conj() or target.is_neg()

    def _item_bytes(self, stream: BinaryIO, path: str, item: ReadItem) -> bytes:
        """The item's bytes, untransformed (bounded by the checked file size)."""
        info = self.storage_data[item.storage_index]
        data = _pread_exactly(stream, info.offset, info.length, path)
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            transforms = getattr(self, "transforms", None)
            if transforms is None:
                raise self._malformed(path, item, f"it names transforms {descriptors} this torch cannot undo")
            try:
                data = transforms.transform_load_stream(item, descriptors, io.BytesIO(data)).read(-1)
            except Exception as exc:  # noqa: BLE001 - a damaged transformed item
                raise self._malformed(path, item, exc) from None
        return data

    def _load_whole(self, stream: BinaryIO, path: str, item: ReadItem) -> torch.Tensor:
        """The requested box of a tensor item the direct path cannot read,
        loaded whole (``torch.load(weights_only=True)``) into a temporary
        and checked against the metadata."""
        data = self._item_bytes(stream, path, item)
        try:
            check_saved_pickles(data, f"'{path}': the item '{item.storage_index.fqn}'")
        except CheckpointError as exc:
            raise self._malformed(path, item, str(exc)) from None
        try:
            with admitted_globals(self.trust):
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not self.trust.trusted)
        except pickle.UnpicklingError as exc:
            raise UnsafeTensorItemError(
                f"'{path}': the tensor item '{item.storage_index.fqn}' was refused by torch.load(weights_only=True) "
                f"({' '.join(str(exc).split())[-200:]}); nothing was written. {HOW_TO_ADMIT}."
            ) from None
        except Exception as exc:  # noqa: BLE001 - a damaged item
            raise self._malformed(path, item, exc) from None
        if not isinstance(tensor, torch.Tensor):
            raise self._malformed(path, item, f"it holds a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        self._check_stored(path, item, tuple(tensor.size()), tensor.dtype, tuple(tensor.stride()), 0, tensor.numel() or 1)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if start < 0 or start + length > tensor.size(dim):
                raise self._malformed(path, item, "the requested box does not fit the stored tensor")
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def _write(self, staged: "_Staged", planner: LoadPlanner) -> None:
        """Hand everything checked to the planner and the destinations."""
        for item, value in staged.objects:
            _deliver(planner, item, value)
        self.counts["stock"] += len(staged.objects)
        for relative_path, item, saved, box, target in staged.direct:
            path, stream = staged.files[relative_path]
            self.counts[self._read_direct(stream, path, item, saved, box, target)] += 1
            planner.commit_tensor(item, target)
        for item, tensor in staged.temporaries:
            target = planner.resolve_tensor(item).detach()
            target.copy_(tensor)
            planner.commit_tensor(item, target)
            self.counts["stock"] += 1

    def _refuse_unsafe_item(self, view: ItemView, path: str, item: ReadItem) -> None:
        """Raise ``UnsafeCheckpointError`` if the tensor item's pickle names
        a global that ``torch.load(weights_only=True)`` does not admit
        (where this torch can tell without unpickling; else the stock
        read refuses it, see ``_load_whole``)."""
        view.seek(0)
        with admitted_globals(self.trust):
            unsafe = unsafe_globals_in(view)
        if unsafe:
            raise UnsafeTensorItemError(
                f"'{path}': the tensor item '{item.storage_index.fqn}' wants {', '.join(unsafe)}, which a tensor does "
                f"not need; refused before anything was written. {HOW_TO_ADMIT}."
            )

    def _malformed(self, path: str, item: ReadItem, why: Any) -> CheckpointError:
        if isinstance(why, BaseException):
            why = f"{type(why).__name__}: {' '.join(str(why).split())[:200]}"
        return CheckpointError(
            f"DirectFileSystemReader: '{path}': the item '{item.storage_index.fqn}' at offset "
            f"{self.storage_data[item.storage_index].offset} is malformed ({why}). The checkpoint is damaged; load "
            "another one. Nothing was written."
        )

    @staticmethod
    def _read_direct(stream: BinaryIO, path: str, item: ReadItem, saved: SavedTensor, box: tuple[int, int, bool], target: torch.Tensor) -> str:
        """Read one checked item into its destination; say how (a ``counts`` key)."""
        first, span, contiguous = box
        start = saved.data_start + first * target.element_size()
        if target.numel() == 0:
            return "direct"
        if contiguous and target.device.type == "cpu" and target.is_contiguous():
            _read_exactly(stream, start, _bytes_of(target), path)
            return "direct"
        temporary = torch.empty(span, dtype=target.dtype)
        _read_exactly(stream, start, _bytes_of(temporary), path)
        target.copy_(temporary.as_strided(tuple(item.lengths), saved.stride, 0))
        return "temporary"


class _Staged:
    """What ``_check_and_stage`` found: the open files, the objects read as
    data, the items to read straight into their destinations, the items
    already read into temporaries."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, BinaryIO]] = {}
        self.objects: list[tuple[ReadItem, Any]] = []
        self.direct: list[tuple[str, ReadItem, SavedTensor, tuple[int, int, bool], torch.Tensor]] = []
        self.temporaries: list[tuple[ReadItem, torch.Tensor]] = []

    def close(self) -> None:
        for _, stream in self.files.values():
            stream.close()
        self.files.clear()


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


def _pread_exactly(stream: BinaryIO, offset: int, length: int, path: str) -> bytes:
    """``length`` bytes of the file from ``offset`` (the caller checked the
    range against the file's size)."""
    target = bytearray(length)
    _read_exactly(stream, offset, memoryview(target), path)
    return bytes(target)


def _read_exactly(stream: BinaryIO, offset: int, target: memoryview, path: str) -> None:
    """Fill ``target`` with the file's bytes from ``offset`` on (``preadv``:
    one system call per item, not a seek and a read)."""
    done, total = 0, len(target)
    positioned = hasattr(os, "preadv")
    if not positioned:
        stream.seek(offset)
    while done < total:
        count = (
            os.preadv(stream.fileno(), [target[done:]], offset + done)
            if positioned
            else stream.readinto(target[done:])  # type: ignore[attr-defined]  # open_regular's streams are FileIO
        )
        if not count:
            raise OSError(
                f"composable_shard DirectFileSystemReader: '{path}' ends at byte {offset + done}, before the "
                f"{total} bytes its checkpoint metadata places at {offset} (a truncated file; load another checkpoint)"
            )
        done += count


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The writable memory of a contiguous CPU tensor."""
    array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy types ndarray.__buffer__ from Python 3.12 on
