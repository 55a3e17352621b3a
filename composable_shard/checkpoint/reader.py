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
  byte order): the stock ``read_data`` reads that item.

Bytes items are read as data (safe_pickle.py), all of them before any value
is handed to the planner, and a tensor item whose pickle wants a global
beyond a tensor's is refused before any tensor is read on this rank; a zip
that torch's reader cannot parse is a ``CheckpointError`` naming the file
and item. Neither reader checks the zip CRCs: ``load_checkpoint`` verifies
the files against the manifest first. Pinned by tests/checkpoint/test_reader.py
(bit for bit against the stock reader) and tests/checkpoint/test_pickles.py.

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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import CheckpointError, UnsafeTensorItemError
from .safe_pickle import HOW_TO_ADMIT, PickleTrust, admitted_globals, load_metadata, load_object, unsafe_globals_in
from .saved_tensor import ItemView, NotDescribed, SavedTensor, box_span, describe_item

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

    def _parse_items(self, relative_path: str, items: list[ReadItem]) -> dict[tuple[int, int], SavedTensor | None]:
        """Each tensor item's description (None: the stock reader reads
        it), reading only its zip records and pickle. Refuses an item
        whose pickle wants a global ``torch.load(weights_only=True)`` would
        refuse, before any item is read."""
        path = os.fspath(self.fs.concat_path(self.path, relative_path))
        parsed: dict[tuple[int, int], SavedTensor | None] = {}
        with open(path, "rb", buffering=0) as stream:
            for item in items:
                info = self.storage_data[item.storage_index]
                where = (info.offset, info.length)
                if where in parsed or getattr(info, "transform_descriptors", None):
                    continue
                view = ItemView(stream, info.offset, info.length)
                try:
                    with admitted_globals(self.trust):
                        parsed[where] = describe_item(view)
                except NotDescribed as why:
                    logger.debug("DirectFileSystemReader: %s in %s at %d: stock reader", why, path, info.offset)
                    parsed[where] = None
                    if why.wants_global and not self.trust.trusted:
                        self._refuse_unsafe_item(view, path, item)
                except (ValueError, OverflowError, IndexError, RuntimeError) as exc:
                    if isinstance(exc, CheckpointError):
                        raise
                    raise self._malformed(path, item, exc) from exc
        return parsed

    def _refuse_unsafe_item(self, view: ItemView, path: str, item: ReadItem) -> None:
        """Raise ``UnsafeCheckpointError`` if the tensor item's pickle names
        a global that ``torch.load(weights_only=True)`` does not admit
        (where this torch can tell without unpickling; else the stock
        read refuses it, see ``_read_stock``)."""
        view.seek(0)
        with admitted_globals(self.trust):
            unsafe = unsafe_globals_in(view)
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
        parsed: dict[tuple[int, int], SavedTensor | None],
    ) -> str | None:
        """``_read_item``, with a malformed item's low-level error said as
        a ``CheckpointError`` naming the file and item."""
        try:
            return self._read_item(stream, path, item, planner, parsed)
        except CheckpointError:
            raise
        except (RuntimeError, ValueError, OverflowError, IndexError) as exc:
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
        parsed: dict[tuple[int, int], SavedTensor | None],
    ) -> str | None:
        """Read one item (described in ``parsed``) into its destination and
        say how (a ``counts`` key); None (nothing done) when the stock reader
        must read it."""
        info = self.storage_data[item.storage_index]
        saved = parsed.get((info.offset, info.length))
        if saved is None:
            return None
        target = planner.resolve_tensor(item).detach()
        box = box_span(saved, tuple(item.storage_offsets), tuple(item.lengths))
        if (
            box is None
            or type(target) is not torch.Tensor
            or target.dtype != saved.dtype
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
            target.copy_(temporary.as_strided(tuple(item.lengths), saved.stride, 0))
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
