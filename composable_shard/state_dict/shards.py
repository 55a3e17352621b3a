"""Owns: how one parameter's local part appears in a sharded state dict — a
``RangeShardedTensor`` of the parameter's original shape whose boxes are the
rectangular pieces that tile this rank's contiguous range — and reading a
rank's range back out of such a value (or out of a full tensor).

Knows nothing of: modules, units, optimizers, collectives (everything here is
computed locally, from the layout).

Public names: ``RangeSharding``, ``range_sharding``, ``range_boxes``,
``stored_shape``, ``LEGACY_SCALAR_SHAPE``, ``is_legacy_scalar``, ``with_shape``,
``sharded_tensor_of_range``, ``range_source_error``,
``read_range``, ``is_sharded_tensor``, ``global_shape``, ``local_range_of``.

[Note: sharded state dict representation]
Outside forward and backward a rank holds one contiguous range
``[local_start, local_start + local_numel)`` of each flattened parameter (see
[Note: flat layout]). Such a range of a multi-dimensional tensor is generally
not a rectangular block, but it always splits into at most ``2 * ndim - 1``
rectangular boxes (a partial innermost row, partial rows of the next
dimension, ..., full leading slices, ..., a partial last row), and each box is
itself a contiguous piece of the range, so a *view* of the rank's 1-D slice.
A sharded state dict therefore holds, per parameter, a ``RangeShardedTensor``
(range_tensor.py) with the **original shape** whose boxes are these (views:
building it copies nothing, and needs no collective: DCP's save planner
learns every rank's boxes from the ranks themselves).

Why boxes of the original shape rather than a 1-D tensor over the flattened
parameter: ``torch.distributed.checkpoint`` then records the original shape
in the checkpoint metadata, reads any overlap of saved and requested boxes
(so a checkpoint saved at one world size or strategy loads at another, and
FSDP2's DTensor rows and our boxes read each other), and its ``format_utils``
converters and any unsharded reader see ordinary tensors with the original
names and shapes.

Replicas (hybrid sharding, ``NO_SHARD``) build identical boxes; DCP's save
planner keeps one copy of each box (its write items are keyed by name and
offset), so replicated data is written once. A 0-dim parameter keeps its
shape ``()`` (one box of no dimensions, on the rank that holds its
element), so a checkpoint loads as it is into FSDP2 and into the unsharded
model. Checkpoints of earlier versions hold it with shape ``(1,)``
(``LEGACY_SCALAR_SHAPE``), and so do checkpoints written where the
ShardedTensor fallback is used (it cannot hold a 0-dim tensor); loading
reads either (``is_legacy_scalar``). Parameters with no elements are plain
empty tensors.

Where the installed torch predates DCP's tensor protocol
(``HAS_DCP_TENSOR_PROTOCOL`` is False) the same boxes become the local shards
of PyTorch's deprecated ``ShardedTensor`` instead; every rank then keeps one
zero-size box just past the end of dimension 0 where its range is empty,
because DCP drops a ShardedTensor without local shards from that rank's
state dict. Reading accepts either form.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..flat_layout import FlatParamLayout, ParamInfo
from .range_tensor import HAS_DCP_TENSOR_PROTOCOL, Box, RangeShardedTensor

__all__ = [
    "RangeSharding",
    "range_sharding",
    "range_boxes",
    "stored_shape",
    "LEGACY_SCALAR_SHAPE",
    "is_legacy_scalar",
    "with_shape",
    "sharded_tensor_of_range",
    "range_source_error",
    "read_range",
    "is_sharded_tensor",
    "global_shape",
    "local_range_of",
]


@dataclass(frozen=True)
class RangeSharding:
    """Which contiguous range of one flattened parameter every rank holds."""

    # The shape stored in state dicts (``stored_shape`` of the parameter's).
    shape: torch.Size
    # This rank's range of the flattened parameter.
    local_start: int
    local_numel: int
    # This rank's global rank (placement of its boxes).
    rank: int
    # (global rank, start, numel) of every rank of the shard group, in group
    # rank order (numel may be 0; replicas list only their own shard group).
    rank_ranges: tuple[tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def range_sharding(info: ParamInfo, layout: FlatParamLayout, group_ranks: Sequence[int], rank: int) -> RangeSharding:
    """The ranges of ``info``'s parameter over the shard group whose global
    ranks are ``group_ranks`` (in group rank order), from the layout alone."""
    rank_ranges = []
    for group_rank, global_rank in enumerate(group_ranks):
        window_start = group_rank * layout.shard_numel
        start = max(info.offset, window_start)
        end = min(info.offset + info.numel, window_start + layout.shard_numel)
        rank_ranges.append((global_rank, start - info.offset, end - start) if end > start else (global_rank, 0, 0))
    return RangeSharding(stored_shape(info.shape), info.local_start, info.local_numel, rank, tuple(rank_ranges))


LEGACY_SCALAR_SHAPE = torch.Size([1])


def stored_shape(shape: Sequence[int]) -> torch.Size:
    """The shape a parameter has in sharded state dicts: its own (``(1,)``
    for a 0-dim one only under the ShardedTensor fallback). See [Note:
    sharded state dict representation]."""
    if len(shape) == 0 and not HAS_DCP_TENSOR_PROTOCOL:
        return LEGACY_SCALAR_SHAPE
    return torch.Size(shape)


def is_legacy_scalar(shape: Sequence[int], saved: Sequence[int]) -> bool:
    """Whether a value saved with shape ``saved`` is a 0-dim parameter of
    ``shape`` stored as ``(1,)`` (earlier versions, the fallback)."""
    return len(shape) == 0 and tuple(saved) == tuple(LEGACY_SCALAR_SHAPE)


def with_shape(sharding: RangeSharding, shape: Sequence[int]) -> RangeSharding:
    """``sharding`` with another stored shape of the same elements (a 0-dim
    parameter read from a ``(1,)`` checkpoint)."""
    if math.prod(shape) != sharding.numel:
        raise ValueError(f"with_shape: {tuple(shape)} does not hold the {sharding.numel} elements of {tuple(sharding.shape)}")
    return dataclasses.replace(sharding, shape=torch.Size(shape))


def range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Split the range ``[start, end)`` of the row-major flattening of a tensor
    of ``shape`` into rectangular boxes, in flat order."""
    if start >= end:
        return []
    ndim = len(shape)
    if ndim == 0:
        return [((), (), start)]
    if ndim == 1:
        return [((start,), (end - start,), start)]
    inner = math.prod(shape[1:])
    first_row, end_row = start // inner, end // inner
    boxes: list[Box] = []
    if start % inner:  # a partial first row
        row_end = min(end, (first_row + 1) * inner)
        base = first_row * inner
        for offsets, sizes, flat in range_boxes(shape[1:], start - base, row_end - base):
            boxes.append(((first_row, *offsets), (1, *sizes), flat + base))
        first_row += 1
        if row_end == end:
            return boxes
    if end_row > first_row:  # whole rows
        boxes.append(((first_row,) + (0,) * (ndim - 1), (end_row - first_row, *shape[1:]), first_row * inner))
    if end % inner:  # a partial last row
        base = end_row * inner
        for offsets, sizes, flat in range_boxes(shape[1:], 0, end - base):
            boxes.append(((end_row, *offsets), (1, *sizes), flat + base))
    return boxes


def sharded_tensor_of_range(local: torch.Tensor, sharding: RangeSharding) -> torch.Tensor:
    """A ``RangeShardedTensor`` of the original shape whose boxes are views
    of ``local`` (1-D, this rank's range). See [Note: sharded state dict
    representation]. An empty parameter gives a plain empty tensor."""
    if sharding.numel == 0:
        return local.new_empty(sharding.shape)
    if not HAS_DCP_TENSOR_PROTOCOL:
        return _legacy_sharded_tensor(local, sharding)
    end = sharding.local_start + sharding.local_numel
    boxes = tuple(range_boxes(sharding.shape, sharding.local_start, end))
    return RangeShardedTensor(local, sharding.shape, sharding.local_start, boxes)


def _legacy_sharded_tensor(local: torch.Tensor, sharding: RangeSharding) -> torch.Tensor:
    """The same boxes as a ShardedTensor, for a torch without DCP's tensor
    protocol (see the module note)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    def boxes(start: int, numel: int) -> list[Box]:
        if numel:
            return range_boxes(sharding.shape, start, start + numel)
        return [((sharding.shape[0],) + (0,) * (len(sharding.shape) - 1), (0, *sharding.shape[1:]), start)]

    device = str(local.device)
    shards_metadata = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}")
        for rank, start, numel in sharding.rank_ranges
        for offsets, sizes, _ in boxes(start, numel)
    ]
    local_shards = []
    for offsets, sizes, flat in boxes(sharding.local_start, sharding.local_numel):
        begin = flat - sharding.local_start
        piece = local[begin : begin + math.prod(sizes)].view(sizes)
        local_shards.append(Shard(piece, ShardMetadata(list(offsets), list(sizes), f"rank:{sharding.rank}/{device}")))
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(shards_metadata, torch.Size(sharding.shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def _legacy_type() -> type | None:
    """PyTorch's ShardedTensor class if anything imported it (else no value
    can be one)."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return getattr(module, "ShardedTensor", None)


def _is_legacy(value: Any) -> bool:
    legacy = _legacy_type()
    return legacy is not None and isinstance(value, legacy)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is one rank's part of a sharded tensor (ours, or a
    ShardedTensor)."""
    return isinstance(value, RangeShardedTensor) or _is_legacy(value)


def global_shape(value: Any) -> torch.Size | None:
    """The full shape of a tensor or sharded value (None for anything else).
    Reads ShardedTensor metadata directly (its tensor methods warn)."""
    if _is_legacy(value):
        return torch.Size(value.metadata().size)
    if isinstance(value, torch.Tensor):
        return value.shape
    return None


def local_range_of(value: RangeShardedTensor) -> tuple[int, torch.Tensor]:
    """(flat start, 1-D data) of the range a RangeShardedTensor holds."""
    return value.local_start, value.local


def _flat_pieces(value: Any) -> list[tuple[int, torch.Tensor]] | None:
    """(flat start, 1-D data) of every non-empty local piece of a sharded
    value, or None if one of them is not a contiguous piece of the
    flattening."""
    if isinstance(value, RangeShardedTensor):
        return [(value.local_start, value.local)] if value.local.numel() else []
    shape = value.metadata().size
    strides = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    pieces = []
    for shard in value.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        numel = math.prod(sizes)
        if numel == 0:
            continue
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, sizes, strides))
        if last - first + 1 != numel:
            return None
        pieces.append((first, shard.tensor.reshape(-1)))
    return pieces


def range_source_error(value: Any, shape: torch.Size, start: int, numel: int) -> str | None:
    """Why ``value`` cannot give the range ``[start, start + numel)`` of a
    tensor of ``shape`` (None when it can): a full tensor of that shape, or a
    sharded value of that shape whose local pieces cover the range."""
    found = global_shape(value)
    if found is None:
        return f"expected a tensor, got {type(value).__name__}"
    if found != shape and not is_legacy_scalar(shape, found):
        return f"shape {tuple(found)} does not match the model's {tuple(shape)}"
    if not is_sharded_tensor(value) or numel == 0:
        return None
    pieces = _flat_pieces(value)
    if pieces is None:
        return "its local shards are not contiguous ranges of the flattened tensor"
    covered = sum(max(0, min(first + len(data), start + numel) - max(first, start)) for first, data in pieces)
    if covered < numel:
        return (
            f"its local shards hold {covered} of the {numel} elements this rank needs; pass the state dict "
            "get_model_state_dict / get_optimizer_state_dict built for this model"
        )
    return None


def _span_view(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """One 1-D view over consecutive pieces that are consecutive views of one
    storage (as the legacy ShardedTensor's local shards are), else None."""
    if not pieces:
        return None
    first0, data0 = pieces[0]
    storage = data0.untyped_storage().data_ptr()
    expected_ptr, expected_first = data0.data_ptr(), first0
    for first, data in pieces:
        if (
            first != expected_first
            or data.untyped_storage().data_ptr() != storage
            or data.data_ptr() != expected_ptr
            or data.dtype != data0.dtype
        ):
            return None
        expected_first += len(data)
        expected_ptr += len(data) * data.element_size()
    return data0.as_strided((expected_first - first0,), (1,), data0.storage_offset())


def read_range(value: Any, start: int, numel: int) -> torch.Tensor:
    """This rank's range (1-D) of ``value``, which ``range_source_error``
    accepted. A view when the source is one piece; otherwise a new tensor."""
    if not is_sharded_tensor(value):
        return value.detach().reshape(-1)[start : start + numel]
    pieces = sorted(_flat_pieces(value) or [], key=lambda piece: piece[0])
    for first, data in pieces:
        if first <= start and start + numel <= first + len(data):
            return data[start - first : start - first + numel]
    span = _span_view(pieces)
    if span is not None and pieces[0][0] <= start and start + numel <= pieces[0][0] + len(span):
        return span[start - pieces[0][0] : start - pieces[0][0] + numel]
    dtype = pieces[0][1].dtype if pieces else value.dtype
    device = pieces[0][1].device if pieces else torch.device("cpu")
    out = torch.empty(numel, dtype=dtype, device=device)
    for first, data in pieces:
        lo, hi = max(first, start), min(first + len(data), start + numel)
        if hi > lo:
            out[lo - start : hi - start].copy_(data[lo - first : hi - first])
    return out
