"""Owns: finding what users changed on their original parameters since the
last step (values, ``requires_grad``, a dtype cast) and refusing, before
anything changes, what cannot be taken.

Knows nothing of: how the flat parameter's storage is rebuilt for a change
(``handle.storage`` applies what this finds), gradients' reduction,
modules' training state, hooks, streams.

Public names: ``UserEdit``, ``ShardedParams``, ``find_user_edits``,
``common_cast_dtype``, ``check_requires_grad_change``.

[Note: changes to original parameters]
Users change their parameters after ``fully_shard``; the handle's
``writeback_orig_params`` takes the changes in between steps (the root's
pre-forward, state dicts, ``unshard_params``), cheaply enough for every
step:

- values (``.data`` assigned, same numel or full shape): copied into the shard;
- ``requires_grad``: each parameter's flag is read once per step into
  ``param_requires_grad``; the layout (grouped by ``requires_grad`` when
  ``fully_shard`` ran) stays, so every parameter keeps its local part and the
  optimizer's state keeps its shapes. The flat parameter needs a gradient
  while any of its parameters does: a flat parameter frozen as a whole gets
  none and is never reduced. A frozen parameter inside a trainable flat
  parameter gets a detached forward view: autograd computes no gradient for
  it, its segment of the flat gradient is zero (``split``'s backward fills
  it), and its ``.grad`` is left as the user left it, as autograd leaves a
  tensor that needs no gradient. Since no gradient flows from its uses into
  the flat parameter's, the flat parameter may be accumulated before those
  uses ran in backward; so it is resharded like a frozen one ([Note:
  resharding frozen flat parameters] in runtime/forward_inputs.py). A change while a
  ``no_sync`` gradient waits for its reduction is refused: the gradient
  accumulated before it would be reduced with the new flags;
- dtype (``model.to(torch.float64)``, ``.double()``, ``.half()``): the flat
  parameter takes the new dtype when all its parameters have it, keeping the
  layout's offsets (every local part keeps its shape; alignment is only a
  speed matter); the compute and reduction dtypes follow unless a
  mixed-precision policy set them. Part of a flat parameter cast alone would
  need a new grouping of the unit: refused, with what to do.

Pinned by tests/training/test_param_changes.py
(test_requires_grad_changes_after_sharding_match_reference,
test_float64_cast_after_sharding_trains_in_parity,
test_cast_of_part_of_a_flat_parameter_is_refused_at_the_next_forward) and
test_writeback_of_replaced_data_and_error_on_changed_size
(tests/handle/test_flat_param.py).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import torch
import torch.nn as nn

from .layout import FlatParamLayout, ParamInfo
from .dtensor_views import local_tensor
from .grads import refuse_grad_dtype

__all__ = ["UserEdit", "ShardedParams", "find_user_edits", "common_cast_dtype", "check_requires_grad_change"]


class UserEdit(NamedTuple):
    """One parameter whose ``.data`` is no longer its view of the shard."""

    info: ParamInfo
    param: nn.Parameter
    # This rank's part of its new value, to copy into the shard; None:
    # nothing to copy (it holds no element here), only point it back.
    local: torch.Tensor | None


class ShardedParams(Protocol):
    """What write-back reads of a handle."""

    layout: FlatParamLayout
    orig_params: tuple[nn.Parameter, ...]
    sharded_flat_param: torch.Tensor


def find_user_edits(handle: ShardedParams, *, name_prefix: str) -> tuple[list[UserEdit], tuple[bool, ...]]:
    """The parameters the user edited, and every parameter's
    ``requires_grad``: one pass, run every step. Raises on a replaced
    parameter object or a changed size; ``name_prefix`` (the unit's name and
    a dot) completes parameter names in messages.

    Takes the handle, not its tensors: under torch.compile (the root's
    pre-forward runs here) a tensor argument is guarded by its shape, so
    every handle would recompile this frame and break its graph again at the
    storage check (test_compile.py records the breaks)."""
    edits: list[UserEdit] = []
    requires_grad: list[bool] = []
    shard_ptr = handle.sharded_flat_param.untyped_storage().data_ptr()
    for info, param in zip(handle.layout.params, handle.orig_params):
        requires_grad.append(param.requires_grad)
        refuse_grad_dtype(param, info.fqn, prefix=name_prefix)  # [Note: a parameter's grad_dtype] in grads.py
        for owner in info.owners:
            if owner.module._parameters.get(owner.attr) is not param:
                raise RuntimeError(
                    f"fully_shard: parameter '{name_prefix}{owner.fqn}' was replaced by another object after "
                    "sharding. Assign to its .data (same shape) or copy_() into it instead."
                )
        # A DTensor parameter is compared by its local tensor ([Note: DTensor
        # parameters] in handle/dtensor_views.py).
        data = local_tensor(param)
        if data.untyped_storage().data_ptr() == shard_ptr and data.numel() == info.local_numel:
            continue
        if data.numel() == info.local_numel and info.local_numel > 0:
            edits.append(UserEdit(info, param, data.detach().reshape(-1)))
        elif data.shape == info.shape and data.numel() > 0:
            local = data.detach().reshape(-1)[info.local_start : info.local_start + info.local_numel]
            edits.append(UserEdit(info, param, local))
        elif data.numel() == 0 and info.local_numel == 0:
            edits.append(UserEdit(info, param, None))
        else:
            raise ValueError(
                f"fully_shard: parameter '{name_prefix}{info.fqn}' changed size behind the shards: it holds "
                f"shape {tuple(data.shape)}, but its unsharded shape is {tuple(info.shape)} and "
                f"this rank's shard of it has {info.local_numel} elements. Change a sharded "
                "parameter's values in place (or inside unshard_params), not its size."
            )
    return edits, tuple(requires_grad)


def common_cast_dtype(
    layout: FlatParamLayout, orig_params: Sequence[nn.Parameter], *, name_prefix: str
) -> torch.dtype | None:
    """The dtype every parameter was cast to (None: still the flat
    parameter's); raises if only some were."""
    dtypes = {param.dtype for param in orig_params}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        return dtype if dtype != layout.dtype else None
    first: dict[torch.dtype, str] = {}
    for info, param in zip(layout.params, orig_params):
        first.setdefault(param.dtype, name_prefix + info.fqn)
    cast_dtype, cast_name = next((d, n) for d, n in first.items() if d != layout.dtype)
    other_dtype, other_name = next((d, n) for d, n in first.items() if d != cast_dtype)
    raise ValueError(
        f"fully_shard: parameter '{cast_name}' was cast to {cast_dtype} after sharding, but '{other_name}', "
        f"which shares its flat parameter, is {other_dtype}. The parameters of a sharded unit are cast "
        "together: cast the whole model or unit (model.to(dtype) works after fully_shard), or cast parts "
        "of it before calling fully_shard. Cast it back to train on."
    )


def check_requires_grad_change(
    layout: FlatParamLayout,
    old: Sequence[bool],
    new: Sequence[bool],
    *,
    grad_waits: bool,
    name_prefix: str,
) -> None:
    """Refuse a ``requires_grad`` change (``old`` to ``new``, per parameter)
    while a ``no_sync`` gradient waits for its reduction (``grad_waits``)."""
    if not grad_waits:
        return
    changed = next(info.fqn for info, before, after in zip(layout.params, old, new) if before != after)
    raise RuntimeError(
        f"fully_shard: parameter '{name_prefix}{changed}' changed requires_grad while gradients accumulated "
        "under no_sync wait for their reduction, which would use the new setting for the whole "
        "accumulation. Change requires_grad after a backward outside no_sync (or set it back)."
    )
