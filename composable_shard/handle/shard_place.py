"""Owns: moving a flat parameter's shard into another tensor of the same
dtype and size (``move_shard``), the parameters that show it following.

Knows nothing of: where the new tensor lives or why (the published shards'
area: runtime/published_shards.py), collectives, hooks.

Public names: ``move_shard``.

A shard moves only between steps while every parameter shows its slice of
it (not the unsharded buffer, which is then memory of its own, also where a
unit stays gathered between steps; no DTensor parameter): then pointing
the handle at the new tensor and the parameters at their slices of it
(``use_sharded_views``, as every reshard does) is the whole move. The
parameter objects stay (optimizers and their state keep them); what held
the old tensor's storage (a view the user kept) sees the old values.
Pinned by tests/runtime/test_published_shards.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from .storage import FlatParamHandle

__all__ = ["move_shard"]


def move_shard(handle: FlatParamHandle, new_shard: Callable[[], torch.Tensor]) -> bool:
    """Put ``new_shard()`` (the values of the handle's shard, 1-D, same
    dtype, size and device) in its place, the parameters pointed at it;
    False, building nothing and changing nothing, where the parameters do
    not all show the shard now. Built and shown outside any
    ``torch.inference_mode`` (a forward may run under it; the views are
    kept and written after it)."""
    if not _shows_its_shard(handle):
        return False
    old = handle.sharded_flat_param
    with torch.inference_mode(False):
        shard = new_shard()
        if shard.shape != old.shape or shard.dtype != old.dtype or shard.device != old.device:
            raise ValueError(
                f"move_shard: a shard of {tuple(old.shape)} {old.dtype} cannot move to {tuple(shard.shape)} {shard.dtype}"
            )
        handle.sharded_flat_param = shard
        handle.use_sharded_views()
    return True


def _shows_its_shard(handle: FlatParamHandle) -> bool:
    """Whether every parameter of the handle shows its slice of the shard
    (plain tensors; an unsharded buffer, if held, is memory of its own)."""
    if handle.shows_unsharded_views or not handle.needs_unshard_storage or any(spec is not None for spec in handle.tp_specs):
        return False
    if handle._shard_views_of is not handle.sharded_flat_param:
        return False
    return all(
        type(param.data) is torch.Tensor and param.data_ptr() == view.data_ptr() and param.shape == view.shape
        for param, view in zip(handle.orig_params, handle._shard_views)
    )
