"""Owns: how one parameter's local part appears in a sharded state dict — a
``RangeShardedTensor`` of the parameter's original shape whose boxes are the
rectangular pieces that tile this rank's contiguous range — reading a rank's
range back out of such a value (or out of a full tensor), and the slices of
a flat parameter that every full/local translation takes (``param_view``,
``local_part``).

Knows nothing of: modules, units, optimizers, collectives (everything here is
computed locally, from the layout).

[Note: sharded state dict representation]
A rank holds one contiguous range of each flattened parameter. Such a range
splits into at most ``2 * ndim - 1`` rectangular boxes, each a view of the
rank's 1-D slice, so a sharded state dict holds per parameter a
``RangeShardedTensor`` of the **original shape** with those boxes: building
it copies nothing and needs no collective, DCP records the original shape
and reads any overlap of saved and requested boxes (so checkpoints reshard
across world sizes and interchange with FSDP2's DTensor rows), and its
converters see ordinary tensors. Replicas build identical boxes, which DCP
writes once. A 0-dim parameter keeps shape ``()``; older checkpoints hold
it as ``(1,)`` (``LEGACY_SCALAR_SHAPE``), which loading accepts
(``is_legacy_scalar``; tests/fixtures/checkpoint_0a0add2). Pinned by
tests/state_dict/test_model.py and tests/checkpoint/test_format.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..handle.layout import FlatParamLayout, ParamInfo
from .range_tensor import Box, RangeShardedTensor

__all__ = [
    "LocalBox",
    "RangeSharding",
    "range_sharding",
    "range_boxes",
    "param_view",
    "local_part",
    "LEGACY_SCALAR_SHAPE",
    "is_legacy_scalar",
    "with_shape",
    "sharded_tensor_of_range",
    "range_source_error",
    "read_range",
    "is_sharded_tensor",
    "global_shape",
]


@dataclass(frozen=True)
class LocalBox:
    """Where a ``DTensor`` parameter's local tensor (what the flat parameter
    holds) lies in its global tensor: one rectangular box.

    [Note: tensor-parallel boxes]
    A rank's range of a tensor-parallel parameter is a range of its *local*
    tensor, so its boxes are computed in local coordinates and shifted by
    the local tensor's offset in the global one (a ``Shard(d)`` local tensor
    is a slab along ``d``; a ``Replicate()`` one is the whole tensor, which
    every tensor-parallel rank then offers with the same indices, written
    once). State-dict values have the global shape, so checkpoints reshard
    across (dp, tp) layouts and interchange with FSDP2's DTensors. Pinned by
    tests/tensor_parallel/test_tp_checkpoint.py."""

    global_shape: torch.Size
    offsets: tuple[int, ...]
    local_shape: torch.Size

    def of_full(self, full: torch.Tensor) -> torch.Tensor:
        """The local tensor's box of a full (global-shape) tensor, a view."""
        index = tuple(slice(start, start + size) for start, size in zip(self.offsets, self.local_shape))
        return full.detach()[index]


@dataclass(frozen=True)
class RangeSharding:
    """Which contiguous range of one flattened parameter every rank holds."""

    # The parameter's shape (another of the same elements for a (1,) checkpoint).
    shape: torch.Size
    # This rank's range of the flattened parameter.
    local_start: int
    local_numel: int
    # This rank's global rank (placement of its boxes).
    rank: int
    # (global rank, start, numel) of every rank of the shard group, in group
    # rank order (numel may be 0; replicas list only their own shard group).
    rank_ranges: tuple[tuple[int, int, int], ...]
    # A DTensor parameter: where its local tensor (``shape``) lies in the
    # global tensor; None for a plain parameter.
    local_box: LocalBox | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def value_shape(self) -> torch.Size:
        """The shape state-dict values of this parameter have (global)."""
        return self.local_box.global_shape if self.local_box is not None else self.shape


def range_sharding(
    info: ParamInfo, layout: FlatParamLayout, group_ranks: Sequence[int], rank: int, local_box: LocalBox | None = None
) -> RangeSharding:
    """The ranges of ``info``'s parameter over the shard group whose global
    ranks are ``group_ranks`` (in group rank order), from the layout alone."""
    rank_ranges = []
    for group_rank, global_rank in enumerate(group_ranks):
        window_start = group_rank * layout.shard_numel
        start = max(info.offset, window_start)
        end = min(info.offset + info.numel, window_start + layout.shard_numel)
        rank_ranges.append((global_rank, start - info.offset, end - start) if end > start else (global_rank, 0, 0))
    return RangeSharding(torch.Size(info.shape), info.local_start, info.local_numel, rank, tuple(rank_ranges), local_box)


LEGACY_SCALAR_SHAPE = torch.Size([1])


def param_view(flat: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    """The parameter ``info`` of a full (unsharded) flat tensor, in its
    original shape (a view)."""
    return flat[info.offset : info.offset + info.numel].view(info.shape)


def local_part(full: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    """This rank's range (1-D) of a full tensor of parameter ``info`` (a view
    where ``full`` is contiguous)."""
    return full.detach().reshape(-1)[info.local_start : info.local_start + info.local_numel]


def is_legacy_scalar(shape: Sequence[int], saved: Sequence[int]) -> bool:
    """Whether a value saved with shape ``saved`` is a 0-dim parameter of
    ``shape`` stored as ``(1,)`` (earlier versions)."""
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
    end = sharding.local_start + sharding.local_numel
    boxes = tuple(range_boxes(sharding.shape, sharding.local_start, end))
    if sharding.local_box is None:
        return RangeShardedTensor(local, sharding.shape, sharding.local_start, boxes)
    # [Note: tensor-parallel boxes]: the same flat positions (of the local
    # tensor), offsets in global coordinates.
    shift = sharding.local_box.offsets
    boxes = tuple((tuple(o + d for o, d in zip(offsets, shift)), sizes, flat) for offsets, sizes, flat in boxes)
    return RangeShardedTensor(local, sharding.local_box.global_shape, sharding.local_start, boxes)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is one rank's part of a sharded tensor."""
    return isinstance(value, RangeShardedTensor)


def global_shape(value: Any) -> torch.Size | None:
    """The full shape of a tensor or sharded value (None for anything else)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    return None


def range_source_error(
    value: Any, shape: torch.Size, start: int, numel: int, local_box: LocalBox | None = None
) -> str | None:
    """Why ``value`` cannot give the range ``[start, start + numel)`` of a
    tensor of ``shape`` (None when it can): a full tensor of that shape, or a
    RangeShardedTensor of that shape whose range covers it. With
    ``local_box`` (a DTensor parameter), ``shape`` is the local tensor's and
    values have the global shape (see [Note: tensor-parallel boxes])."""
    if local_box is not None:
        shape = local_box.global_shape
    found = global_shape(value)
    if found is None:
        return f"expected a tensor, got {type(value).__name__}"
    if found != shape and not is_legacy_scalar(shape, found):
        return f"shape {tuple(found)} does not match the model's {tuple(shape)}"
    if not is_sharded_tensor(value) or numel == 0:
        return None
    held_start, held = value.local_start, value.local.numel()
    covered = max(0, min(held_start + held, start + numel) - max(held_start, start))
    if covered < numel:
        return (
            f"its local shards hold {covered} of the {numel} elements this rank needs; pass the state dict "
            "get_model_state_dict / get_optimizer_state_dict built for this model"
        )
    return None


def read_range(value: Any, start: int, numel: int, local_box: LocalBox | None = None) -> torch.Tensor:
    """This rank's range (1-D) of ``value``, which ``range_source_error``
    accepted: a view of it (of a full value of a DTensor parameter:
    ``local_box``'s part first)."""
    if not is_sharded_tensor(value):
        if local_box is not None:
            value = local_box.of_full(value).contiguous()
        return value.detach().reshape(-1)[start : start + numel]
    begin = start - value.local_start
    return value.local[begin : begin + numel]
