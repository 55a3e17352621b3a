"""Owns: the immutable layout of one flat parameter — where each original
parameter lives in the padded unsharded flat buffer and which slice of it this
rank's shard holds.

Knows nothing of: storage, collectives, hooks, training state.

Public names: ``ParamOwner``, ``ParamInfo``, ``FlatParamLayout``,
``compute_layout``, ``ALIGNMENT_BYTES``.

[Note: flat layout]
The unsharded flat buffer is the concatenation of the parameters, each
starting at an offset aligned to ``ALIGNMENT_BYTES`` (padding between them),
followed by tail padding so that its numel divides the shard group's size.
Rank ``r`` of the shard group holds elements ``[r * shard_numel,
(r + 1) * shard_numel)``. A parameter's local part is the intersection of its
range with that window: one contiguous range of the flattened parameter, so
ranks hold the parameter's elements in rank order. Pinned by
test_layout_of_a_small_module_is_stable (tests/handle/test_flat_param.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["ALIGNMENT_BYTES", "ParamOwner", "ParamInfo", "FlatParamLayout", "compute_layout"]

# Every parameter's view starts at a multiple of this many bytes, so vectorised
# kernels see aligned data (16 bytes: one 128-bit load).
ALIGNMENT_BYTES = 16


@dataclass(frozen=True, eq=False)
class ParamOwner:
    """One place a parameter is registered: ``module._parameters[attr]``."""

    module: nn.Module
    attr: str
    # Name relative to the unit's root module ("" prefix-free), for messages.
    fqn: str


@dataclass(frozen=True, eq=False)
class ParamInfo:
    """Where one original parameter lives in the flat parameter.

    Tied parameters appear once with several ``owners``.
    """

    owners: tuple[ParamOwner, ...]
    shape: torch.Size
    numel: int
    # Start of this parameter in the padded unsharded flat buffer (aligned).
    offset: int
    # First element of the flattened parameter held by this rank.
    local_start: int
    # Number of elements of this parameter held by this rank (may be 0).
    local_numel: int
    # Where those elements start inside this rank's shard.
    shard_offset: int

    @property
    def fqn(self) -> str:
        return self.owners[0].fqn

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(owner.fqn for owner in self.owners)


@dataclass(frozen=True, eq=False)
class FlatParamLayout:
    """The layout of one flat parameter (one dtype, one ``requires_grad``).

    Computed once; everything else (views, gradient slices, state dicts)
    derives from it. See [Note: flat layout].
    """

    params: tuple[ParamInfo, ...]
    # The parameters' dtype (a cast after sharding replaces the layout with
    # one of the new dtype and the same offsets).
    dtype: torch.dtype
    # The parameters' requires_grad when fully_shard grouped them; later
    # changes live in FlatParamHandle.param_requires_grad (see [Note: changes
    # to original parameters] in handle/writeback.py).
    requires_grad: bool
    # Sizes of consecutive segments of the padded unsharded buffer: each
    # parameter's segment is preceded by its alignment padding (if any) and
    # the tail padding comes last; ``param_segments[i]`` indexes parameter i.
    split_sizes: tuple[int, ...]
    param_segments: tuple[int, ...]
    # Numel of parameters plus alignment padding, before tail padding.
    unpadded_numel: int
    # Numel of the unsharded flat buffer; a multiple of shard_world_size.
    padded_unsharded_numel: int
    # Numel of one rank's shard: padded_unsharded_numel / shard_world_size.
    shard_numel: int
    shard_rank: int
    shard_world_size: int

    @property
    def total_param_numel(self) -> int:
        return sum(info.numel for info in self.params)

    @functools.cached_property
    def shard_split(self) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
        """This rank's shard cut as ``split_sizes`` cuts the unsharded
        buffer: consecutive segment sizes covering the shard (each
        parameter's local part, padding between them), and per parameter
        the index of its local part's segment (None: it holds no element
        here). One ``split`` then gives every parameter's part of a
        sharded gradient."""
        sizes: list[int] = []
        segments: list[int | None] = []
        at = 0
        for info in self.params:
            if not info.local_numel:
                segments.append(None)
                continue
            if info.shard_offset > at:
                sizes.append(info.shard_offset - at)
            segments.append(len(sizes))
            sizes.append(info.local_numel)
            at = info.shard_offset + info.local_numel
        if self.shard_numel > at:
            sizes.append(self.shard_numel - at)
        return tuple(sizes), tuple(segments)

    def describe(self) -> str:
        """A stable text form of the layout (for tests and debugging)."""
        lines = [
            f"FlatParamLayout(dtype={self.dtype}, requires_grad={self.requires_grad}, "
            f"padded_unsharded_numel={self.padded_unsharded_numel}, "
            f"shard_numel={self.shard_numel}, shard_rank={self.shard_rank}/{self.shard_world_size})"
        ]
        for info in self.params:
            names = ",".join(info.fqns)
            lines.append(
                f"  {names}: shape={tuple(info.shape)} offset={info.offset} numel={info.numel} "
                f"local=[{info.local_start}:{info.local_start + info.local_numel}] "
                f"shard_offset={info.shard_offset}"
            )
        return "\n".join(lines)


def _aligned(offset: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    align_numel = max(1, ALIGNMENT_BYTES // itemsize)
    return -(-offset // align_numel) * align_numel


def compute_layout(
    params: Sequence[tuple[torch.Size, tuple[ParamOwner, ...]]],
    *,
    dtype: torch.dtype,
    requires_grad: bool,
    shard_rank: int,
    shard_world_size: int,
) -> FlatParamLayout:
    """Lay out ``params`` (shape and owners each) for this shard rank."""
    split_sizes: list[int] = []
    param_segments: list[int] = []
    offsets: list[int] = []
    cursor = 0
    for shape, _ in params:
        aligned = _aligned(cursor, dtype)
        if aligned > cursor:
            split_sizes.append(aligned - cursor)
        param_segments.append(len(split_sizes))
        numel = int(torch.Size(shape).numel())
        split_sizes.append(numel)
        offsets.append(aligned)
        cursor = aligned + numel
    unpadded_numel = cursor
    # At least one element per rank, so every rank has a non-empty shard to
    # all-gather (collectives on empty tensors are not portable).
    padded = max(-(-unpadded_numel // shard_world_size) * shard_world_size, shard_world_size)
    if padded > unpadded_numel:
        split_sizes.append(padded - unpadded_numel)
    shard_numel = padded // shard_world_size
    window_start, window_end = shard_rank * shard_numel, (shard_rank + 1) * shard_numel

    infos = []
    for (shape, owners), offset in zip(params, offsets):
        numel = int(torch.Size(shape).numel())
        start = max(offset, window_start)
        end = min(offset + numel, window_end)
        if end > start:
            local_start, local_numel, shard_offset = start - offset, end - start, start - window_start
        else:
            # Empty local part; place the 0-numel view where it would start.
            local_start, local_numel = 0, 0
            shard_offset = min(max(offset - window_start, 0), shard_numel)
        infos.append(
            ParamInfo(
                owners=tuple(owners),
                shape=torch.Size(shape),
                numel=numel,
                offset=offset,
                local_start=local_start,
                local_numel=local_numel,
                shard_offset=shard_offset,
            )
        )
    return FlatParamLayout(
        params=tuple(infos),
        dtype=dtype,
        requires_grad=requires_grad,
        split_sizes=tuple(split_sizes),
        param_segments=tuple(param_segments),
        unpadded_numel=unpadded_numel,
        padded_unsharded_numel=padded,
        shard_numel=shard_numel,
        shard_rank=shard_rank,
        shard_world_size=shard_world_size,
    )
