"""Owns: the storage of one flat parameter — its sharded and unsharded
buffers, the original parameters' views into them, gradient reduction into
the sharded gradient, write-back of user edits, and the mixed-precision and
offload copies.

Knows nothing of: modules' training state, hooks, streams (collectives are
issued through ``comm`` and returned as ``PendingCollective`` for the
scheduler to wait on).

Public names: ``FlatParamHandle``, ``FlatParamSource``,
``set_grad_of_other_dtype``.

[Note: flat parameter storage]
``sharded_flat_param`` (1-D, ``shard_numel``) holds this rank's shard in the
parameters' own dtype; it is the optimizer's master copy, since outside
forward and backward every original ``nn.Parameter``'s ``.data`` is a 1-D view
into it. ``unsharded_flat_param`` (1-D, ``padded_unsharded_numel``, compute
dtype) is an autograd leaf that lives for the handle's lifetime; resharding
frees its *storage* (``resize_(0)``) but keeps the tensor, so the views that
forward saved for backward stay valid once ``unshard`` refills the same
storage. Forward uses views of it built with one ``split`` (its backward
writes one padded gradient, not one per parameter); its ``.grad`` is the
padded unsharded gradient that ``reduce_grad`` reduce-scatters.

When the shard group has one rank and no copy is needed (same dtype, same
device), the unsharded flat parameter shares the shard's storage and nothing
is ever gathered or freed.

[Note: changes to original parameters]
Users change their parameters after ``fully_shard``; ``writeback_orig_params``
takes the changes in between steps (the root's pre-forward, state dicts,
``unshard_params``), cheaply enough for every step:

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
  resharding frozen flat parameters] in runtime.py). A change while a
  ``no_sync`` gradient waits for its reduction is refused: the gradient
  accumulated before it would be reduced with the new flags;
- dtype (``model.to(torch.float64)``, ``.double()``, ``.half()``): the flat
  parameter takes the new dtype when all its parameters have it, keeping the
  layout's offsets (every local part keeps its shape; alignment is only a
  speed matter); the compute and reduction dtypes follow unless a
  mixed-precision policy set them. Part of a flat parameter cast alone would
  need a new grouping of the unit: refused, with what to do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from . import comm
from .comm import PendingCollective, ShardGroups
from .flat_layout import FlatParamLayout, ParamInfo, ParamOwner, compute_layout

__all__ = ["FlatParamHandle", "FlatParamSource", "set_grad_of_other_dtype"]


def set_grad_of_other_dtype(
    param: nn.Parameter, grad: torch.Tensor, placeholder: torch.Tensor | None = None
) -> torch.Tensor:
    """Make ``grad``, of another dtype than ``param`` (a low-precision
    gradient: ``keep_low_precision_grads``), the parameter's ``.grad``.

    Autograd only accepts a ``.grad`` of the parameter's dtype, device and
    shape, so a stand-in that has them is assigned and ``grad`` swapped in
    through ``.data``. The stand-in is a stride-0 view of ``placeholder``
    (0-dim, the parameter's dtype and device; a new one when not given or
    not matching): no parameter-sized allocation per parameter per step,
    and none at all for a caller that keeps the returned placeholder."""
    if placeholder is None or placeholder.dtype != param.dtype or placeholder.device != param.device:
        placeholder = torch.empty((), dtype=param.dtype, device=param.device)
    param.grad = placeholder.expand(param.shape)
    param.grad.data = grad
    return placeholder


class FlatParamSource(NamedTuple):
    """One original parameter to flatten and every place it is registered."""

    param: nn.Parameter
    owners: tuple[ParamOwner, ...]


class FlatParamHandle:
    """One flat parameter: a group of a unit's parameters sharing a dtype and
    ``requires_grad``. See [Note: flat parameter storage]."""

    def __init__(
        self,
        sources: Sequence[FlatParamSource],
        groups: ShardGroups,
        *,
        compute_device: torch.device,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        keep_low_precision_grads: bool = False,
        offload_params: bool = False,
    ) -> None:
        if not sources:
            raise ValueError("FlatParamHandle needs at least one parameter")
        first = sources[0].param
        self.groups = groups
        self.layout: FlatParamLayout = compute_layout(
            [(src.param.shape, src.owners) for src in sources],
            dtype=first.dtype,
            requires_grad=first.requires_grad,
            shard_rank=groups.shard_rank,
            shard_world_size=groups.shard_world_size,
        )
        if groups.is_sharded:
            # The most one rank writes for this handle's collectives (a
            # reduce-scatter writes every chunk but its own): the shared
            # memory of the group is checked and reserved for it (see
            # [Note: one transport per group] in comm/transport.py).
            itemsize = max(dtype.itemsize for dtype in (first.dtype, param_dtype or first.dtype, reduce_dtype or first.dtype))
            comm.expect_collective_bytes(
                groups.shard_group, self.layout.shard_numel * itemsize * max(1, groups.shard_world_size - 1)
            )
        # The user's parameter objects, in layout order; identity is kept.
        self.orig_params: tuple[nn.Parameter, ...] = tuple(src.param for src in sources)
        # Device forward and backward run on (where the unsharded buffer lives).
        self.compute_device = compute_device
        # The mixed-precision policy's dtypes (None: follow the parameters'
        # dtype, also after a cast; see [Note: changes to original parameters]).
        self._policy_param_dtype = param_dtype
        self._policy_reduce_dtype = reduce_dtype
        # Dtype of the unsharded buffer (all-gather and compute).
        self.param_dtype: torch.dtype = param_dtype or first.dtype
        # Dtype gradients are reduced in.
        self.reduce_dtype: torch.dtype = reduce_dtype or self.param_dtype
        # Each original parameter's requires_grad as the last write-back read
        # it (see [Note: changes to original parameters]).
        self.param_requires_grad: tuple[bool, ...] = (first.requires_grad,) * len(sources)
        # Whether any parameter ever required grad since sharding: only then
        # can they hold gradients (the same on every rank, so collectives on
        # gradients may depend on it).
        self.ever_required_grad: bool = first.requires_grad
        self.keep_low_precision_grads = keep_low_precision_grads
        # Shard (and sharded gradient) live on CPU between uses.
        self.offload_params = offload_params
        shard_device = torch.device("cpu") if offload_params else compute_device

        # 1-D, shard_numel, parameters' dtype: this rank's shard (master copy).
        self.sharded_flat_param: torch.Tensor = self._build_shard(shard_device)
        # True when the unsharded buffer must be a separate allocation.
        self.needs_unshard_storage: bool = self._needs_unshard_storage()
        # 1-D, padded_unsharded_numel, param_dtype: autograd leaf whose storage
        # is freed while resharded (see the module note).
        self.unsharded_flat_param: torch.Tensor = self._build_unsharded().requires_grad_(self.requires_grad)
        # True while the unsharded buffer holds the gathered data.
        self.is_unsharded: bool = not self.needs_unshard_storage
        # True while the owners hold forward views of the unsharded buffer
        # instead of the original parameters.
        self.shows_unsharded_views: bool = False
        # Every parameter's view of the shard, built once per shard tensor
        # (resharding runs every step for every unit).
        self._shard_views: tuple[torch.Tensor, ...] = ()
        self._shard_views_of: torch.Tensor | None = None
        # 0-dim, the parameters' dtype, on the shard's device: the storage
        # every low-precision ``.grad`` is first assigned as a view of
        # (``set_grad_of_other_dtype``); None until the first one.
        self._grad_placeholder: torch.Tensor | None = None
        self.use_sharded_views()

    # ------------------------------------------------------------------ init
    def _build_shard(self, device: torch.device) -> torch.Tensor:
        layout = self.layout
        shard = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=device)
        with torch.no_grad():
            for info, param in zip(layout.params, self.orig_params):
                if info.local_numel:
                    local = param.detach().reshape(-1)[info.local_start : info.local_start + info.local_numel]
                    shard[info.shard_offset : info.shard_offset + info.local_numel].copy_(local)
        if device.type == "cpu" and self.compute_device.type == "cuda":
            # CPU offload: pinned, so the copy to the device for the
            # all-gather is asynchronous on the all-gather stream.
            shard = shard.pin_memory()
        return shard

    def _needs_unshard_storage(self) -> bool:
        return (
            self.groups.is_sharded
            or self.param_dtype != self.layout.dtype
            or self.sharded_flat_param.device != self.compute_device
        )

    def _build_unsharded(self) -> torch.Tensor:
        """The unsharded buffer's data: the shard itself, or freed storage."""
        if not self.needs_unshard_storage:
            return self.sharded_flat_param.detach()
        unsharded = torch.empty(self.layout.padded_unsharded_numel, dtype=self.param_dtype, device=self.compute_device)
        unsharded.untyped_storage().resize_(0)
        return unsharded

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of the gathered flat parameter (padded, in the compute dtype)."""
        return self.layout.padded_unsharded_numel * self.param_dtype.itemsize

    # ----------------------------------------------------- requires_grad
    @property
    def requires_grad(self) -> bool:
        """Whether the flat parameter gets a gradient (some parameter of it
        requires grad); see [Note: changes to original parameters]."""
        return any(self.param_requires_grad)

    @property
    def has_frozen_params(self) -> bool:
        return not all(self.param_requires_grad)

    # ----------------------------------------------------------------- views
    def local_shard_view(self, info: ParamInfo) -> torch.Tensor:
        """This rank's part of one parameter: a 1-D view of the shard."""
        return self.sharded_flat_param[info.shard_offset : info.shard_offset + info.local_numel]

    def use_sharded_views(self) -> None:
        """Point every original parameter at its 1-D slice of the shard and
        register it back on its owners."""
        if self._shard_views_of is not self.sharded_flat_param:
            self._shard_views = tuple(self.local_shard_view(info) for info in self.layout.params)
            self._shard_views_of = self.sharded_flat_param
        for param, view in zip(self.orig_params, self._shard_views):
            param.data = view
        self._register_orig_params()

    def _register_orig_params(self) -> None:
        """Register the original parameters back on their owners (their
        ``.data`` is left as it is)."""
        for info, param in zip(self.layout.params, self.orig_params):
            for owner in info.owners:
                owner.module._parameters[owner.attr] = param
        self.shows_unsharded_views = False

    def hide_unsharded_views(self) -> None:
        """Show the owners the original parameters (the shard) again and
        keep the unsharded buffer gathered: a unit held for its backward
        (see [Note: held for backward] in runtime.py); ``reshard`` frees it."""
        self._register_orig_params()

    def use_unsharded_views(self) -> None:
        """Give the owners autograd views of the unsharded flat parameter
        (forward and backward), so gradients flow into its ``.grad``.

        Built anew at every unshard, not kept: the autograd engine runs
        ready nodes newest first, and views kept from the first step would
        put their split's backward (and so this flat parameter's
        post-accumulate-grad hook, which reduces and frees the gradient)
        behind every node of later steps, i.e. at the end of backward."""
        self._check_unsharded("use_unsharded_views")
        segments = torch.split(self.unsharded_flat_param, self.layout.split_sizes)
        for info, index, requires_grad in zip(self.layout.params, self.layout.param_segments, self.param_requires_grad):
            view = segments[index]
            if view.shape != info.shape:  # 1-D parameters use their segment as it is
                view = view.view(info.shape)
            if not requires_grad and view.requires_grad:
                view = view.detach()  # frozen: see [Note: changes to original parameters]
            for owner in info.owners:
                owner.module._parameters[owner.attr] = view
        self.shows_unsharded_views = True

    # ------------------------------------------------------ unshard/reshard
    def unshard(self, *, async_op: bool) -> PendingCollective | None:
        """Allocate the unsharded buffer and start filling it from every
        rank's shard. Returns the pending all-gather (None if nothing to
        wait for). Does not change the views: call ``use_unsharded_views``
        once the all-gather is done."""
        if self.is_unsharded:
            return None
        storage = self.unsharded_flat_param.untyped_storage()
        storage.resize_(self.unsharded_flat_param.numel() * self.unsharded_flat_param.element_size())
        # ``.data`` so the write is not seen by autograd's version counter:
        # tensors saved for backward alias this storage on purpose.
        output = self.unsharded_flat_param.data
        self.is_unsharded = True
        if not self.groups.is_sharded:
            # The shard is this rank's whole flat parameter: copied into the
            # buffer (uploaded first when a cast is needed, so the cast runs
            # on the device). No collective, but the copy is the lane's work,
            # fenced by the scheduler like one (see [Note: lane fences]).
            shard = self.sharded_flat_param
            if shard.dtype != output.dtype:
                shard = self._shard_on_compute_device()
            output.copy_(shard, non_blocking=True)
            return None
        source = self._all_gather_source()
        work = comm.all_gather_into(output, source, self.groups.shard_group, async_op=async_op)
        return PendingCollective(work, output, (source,))

    def _shard_on_compute_device(self) -> torch.Tensor:
        """The shard in its own dtype on the compute device. With CPU offload,
        a temporary uploaded from the pinned shard without blocking the host
        (see [Note: CPU offload copies]); else the shard itself."""
        shard = self.sharded_flat_param
        if shard.device == self.compute_device:
            return shard
        return shard.to(self.compute_device, non_blocking=True)

    def _all_gather_source(self) -> torch.Tensor:
        """The shard as the all-gather reads it: on the compute device, in the
        compute dtype (a temporary when either differs; the cast runs on the
        device, after the upload)."""
        return self._shard_on_compute_device().to(self.param_dtype)

    def reshard(self, *, free_storage: bool = True) -> None:
        """Show the shard again and free the unsharded buffer's storage; with
        ``free_storage=False`` the storage stays allocated until
        ``free_unsharded_storage`` (the scheduler decides when its block may
        be reused: [Note: what a lane waits for] in scheduler.py).

        The parameters' ``.data`` already is the shard's views (forward
        showed the owners other tensors, not other data); only
        ``show_full_params`` and the user change it, and the root's
        pre-forward (``writeback_orig_params``) or ``unshard_params`` put
        it back. So only the owners' registrations are restored here."""
        self._register_orig_params()
        if self.needs_unshard_storage and self.is_unsharded:
            self.is_unsharded = False
            if free_storage:
                self.free_unsharded_storage()

    def free_unsharded_storage(self) -> None:
        """Free the storage ``reshard(free_storage=False)`` left allocated (a
        no-op once freed, or if the handle was unsharded again)."""
        if self.needs_unshard_storage and not self.is_unsharded:
            self.unsharded_flat_param.untyped_storage().resize_(0)

    def unsharded_storage_bytes(self) -> int:
        """Bytes the unsharded buffer holds now (0 when resharded and separate,
        once its storage was freed)."""
        if not self.needs_unshard_storage:
            return 0
        return self.unsharded_flat_param.untyped_storage().nbytes()

    def _check_unsharded(self, what: str) -> None:
        if not self.is_unsharded:
            names = ", ".join(info.fqn for info in self.layout.params[:3])
            raise RuntimeError(f"FlatParamHandle({names}, ...): {what} needs the handle unsharded; call unshard() first")

    # ----------------------------------------------------------- write-back
    def writeback_orig_params(self, *, name_prefix: str = "") -> bool:
        """Take in what the user changed on the original parameters since the
        last call: ``requires_grad``, a dtype cast, and ``.data`` assigned
        (same numel, or the full shape) or cast, copied into the shard. See
        [Note: changes to original parameters]. Returns whether any value was
        written back. Raises on a change that cannot be taken (a replaced
        parameter object, a changed size, part of the flat parameter cast, a
        ``requires_grad`` change while a ``no_sync`` gradient waits) before
        changing anything; ``name_prefix`` (the unit's name and a dot)
        completes parameter names in messages. Skipped while forward views
        are shown (between a forward and its backward the parameters are not
        the user's to edit)."""
        if self.shows_unsharded_views:
            return False
        edits, requires_grad = self._user_edits(name_prefix)
        # A cast gives every parameter it changes new storage: only edited
        # parameters can have another dtype.
        cast = any(param.dtype != self.layout.dtype for _, param, _ in edits)
        dtype = self._cast_dtype(name_prefix) if cast else None
        if requires_grad != self.param_requires_grad:
            self._set_requires_grad(requires_grad, name_prefix)
        if dtype is not None:
            self._change_dtype(dtype)
        if not edits:
            return False
        with torch.no_grad():
            for info, param, local in edits:
                if local is not None:
                    self.local_shard_view(info).copy_(local)
                param.data = self.local_shard_view(info)
        return any(local is not None for _, _, local in edits)

    def _user_edits(
        self, name_prefix: str
    ) -> tuple[list[tuple[ParamInfo, nn.Parameter, torch.Tensor | None]], tuple[bool, ...]]:
        """Parameters whose ``.data`` is no longer their view of the shard,
        each with its local part to copy in (None: nothing to copy, only
        point it at the shard again), and every parameter's
        ``requires_grad``: one pass, run every step. Checks registrations
        and sizes."""
        edits: list[tuple[ParamInfo, nn.Parameter, torch.Tensor | None]] = []
        requires_grad: list[bool] = []
        shard_ptr = self.sharded_flat_param.untyped_storage().data_ptr()
        for info, param in zip(self.layout.params, self.orig_params):
            requires_grad.append(param.requires_grad)
            for owner in info.owners:
                if owner.module._parameters.get(owner.attr) is not param:
                    raise RuntimeError(
                        f"fully_shard: parameter '{name_prefix}{owner.fqn}' was replaced by another object after "
                        "sharding. Assign to its .data (same shape) or copy_() into it instead."
                    )
            if param.untyped_storage().data_ptr() == shard_ptr and param.numel() == info.local_numel:
                continue
            if param.numel() == info.local_numel and info.local_numel > 0:
                edits.append((info, param, param.detach().reshape(-1)))
            elif param.shape == info.shape and param.numel() > 0:
                local = param.detach().reshape(-1)[info.local_start : info.local_start + info.local_numel]
                edits.append((info, param, local))
            elif param.numel() == 0 and info.local_numel == 0:
                edits.append((info, param, None))
            else:
                raise ValueError(
                    f"fully_shard: parameter '{name_prefix}{info.fqn}' changed size behind the shards: it holds "
                    f"shape {tuple(param.shape)}, but its unsharded shape is {tuple(info.shape)} and "
                    f"this rank's shard of it has {info.local_numel} elements. Change a sharded "
                    "parameter's values in place (or inside unshard_params), not its size."
                )
        return edits, tuple(requires_grad)

    def _cast_dtype(self, name_prefix: str) -> torch.dtype | None:
        """The dtype every parameter was cast to (None: the flat
        parameter's); raises if only some were."""
        dtypes = {param.dtype for param in self.orig_params}
        if len(dtypes) == 1:
            dtype = dtypes.pop()
            return dtype if dtype != self.layout.dtype else None
        first: dict[torch.dtype, str] = {}
        for info, param in zip(self.layout.params, self.orig_params):
            first.setdefault(param.dtype, name_prefix + info.fqn)
        cast_dtype, cast_name = next((d, n) for d, n in first.items() if d != self.layout.dtype)
        other_dtype, other_name = next((d, n) for d, n in first.items() if d != cast_dtype)
        raise ValueError(
            f"fully_shard: parameter '{cast_name}' was cast to {cast_dtype} after sharding, but '{other_name}', "
            f"which shares its flat parameter, is {other_dtype}. The parameters of a sharded unit are cast "
            "together: cast the whole model or unit (model.to(dtype) works after fully_shard), or cast parts "
            "of it before calling fully_shard. Cast it back to train on."
        )

    def _set_requires_grad(self, requires_grad: tuple[bool, ...], name_prefix: str) -> None:
        if self.unsharded_flat_param.grad is not None:
            flips = zip(self.layout.params, self.param_requires_grad, requires_grad)
            changed = next(info.fqn for info, old, new in flips if old != new)
            raise RuntimeError(
                f"fully_shard: parameter '{name_prefix}{changed}' changed requires_grad while gradients accumulated "
                "under no_sync wait for their reduction, which would use the new setting for the whole "
                "accumulation. Change requires_grad after a backward outside no_sync (or set it back)."
            )
        self.param_requires_grad = requires_grad
        self.ever_required_grad = self.ever_required_grad or self.requires_grad
        self.unsharded_flat_param.requires_grad_(self.requires_grad)

    def _change_dtype(self, dtype: torch.dtype) -> None:
        """Give the flat parameter ``dtype``, keeping its layout's offsets
        (see [Note: changes to original parameters]). The shard starts as a
        cast of the old one (padding, empty parts); the caller copies the
        parameters' values in."""
        old_shard = self.sharded_flat_param
        with torch.no_grad():
            shard = old_shard.to(dtype)
        if shard.device.type == "cpu" and self.compute_device.type == "cuda":
            shard = shard.pin_memory()  # as _build_shard: offloaded shards are pinned
        self.layout = dataclasses.replace(self.layout, dtype=dtype)
        self.sharded_flat_param = shard
        self.param_dtype = self._policy_param_dtype or dtype
        self.reduce_dtype = self._policy_reduce_dtype or self.param_dtype
        self.needs_unshard_storage = self._needs_unshard_storage()
        # The same autograd leaf (its post-accumulate-grad hook stays) with
        # new data; a gradient accumulated under no_sync follows the dtype.
        pending_grad = self.unsharded_flat_param.grad
        self.unsharded_flat_param.grad = None
        self.unsharded_flat_param.data = self._build_unsharded()
        if pending_grad is not None:
            self.unsharded_flat_param.grad = pending_grad.to(self.param_dtype)
        self.is_unsharded = not self.needs_unshard_storage

    # ---------------------------------------------- full copies (unshard_params)
    def gather_full_flat_param(self) -> torch.Tensor:
        """A new padded unsharded copy of the flat parameter in its own dtype
        (not the compute dtype), gathered synchronously. Collective."""
        return self.gather_full(self.sharded_flat_param)

    def gather_full_flat_grad(self) -> torch.Tensor:
        """A new padded unsharded copy of the gradients the parameters hold
        now (zeros where they hold none). Collective."""
        sharded_grad = self._collect_user_grads()
        if sharded_grad is None:
            sharded_grad = torch.zeros_like(self.sharded_flat_param)
        return self.gather_full(sharded_grad)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """A new padded unsharded tensor gathered from every rank's
        ``shard`` (shard_numel each, any dtype). Collective."""
        shard = shard.to(self.compute_device)
        if not self.groups.is_sharded:
            return shard.clone()
        full = torch.empty(self.layout.padded_unsharded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into(full, shard, self.groups.shard_group, async_op=False)
        return full

    def show_full_params(self, full_flat: torch.Tensor, full_grad: torch.Tensor | None) -> None:
        """Point each original parameter's ``.data`` (and ``.grad``, when
        ``full_grad`` is given) at its view of the full copies."""
        param_views = self._views_of(full_flat)
        grad_views = self._views_of(full_grad) if full_grad is not None else [None] * len(param_views)
        for info, param, view, grad_view in zip(self.layout.params, self.orig_params, param_views, grad_views):
            param.data = view
            if full_grad is not None:
                param.grad = grad_view if grad_view.dtype == param.dtype else grad_view.to(param.dtype)
            for owner in info.owners:
                owner.module._parameters[owner.attr] = param

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        segments = torch.split(flat.detach(), self.layout.split_sizes)
        return [segments[index].view(info.shape) for info, index in zip(self.layout.params, self.layout.param_segments)]

    def load_shard_from_full(self, full_flat: torch.Tensor) -> None:
        """Copy this rank's window of a full flat copy into the shard."""
        start = self.layout.shard_rank * self.layout.shard_numel
        with torch.no_grad():
            window = full_flat[start : start + self.layout.shard_numel]
            self.sharded_flat_param.copy_(window)

    # ------------------------------------------------------------- gradients
    def has_unsharded_grad(self) -> bool:
        return self.unsharded_flat_param.grad is not None

    def reduce_grad(self, *, async_op: bool) -> PendingCollective | None:
        """Start reducing the padded unsharded gradient over the shard group
        (reduce-scatter) or, unsharded, over the replicate group
        (all-reduce). The unsharded gradient is released from the flat
        parameter; the returned pending collective keeps it alive."""
        unsharded_grad = self.unsharded_flat_param.grad
        if unsharded_grad is None:
            return None
        self.unsharded_flat_param.grad = None
        # Kept in the pending collective: on CUDA the cast below reads it on
        # the lane's stream, and compute (which allocated it) may reuse its
        # memory only after waiting on the fence ([Note: buffer lifetimes
        # across lanes] in scheduler.py).
        computed_grad = unsharded_grad
        if unsharded_grad.dtype != self.reduce_dtype:
            unsharded_grad = unsharded_grad.to(self.reduce_dtype)
        predivide = self._predivide_factor()
        if predivide != 1.0:
            unsharded_grad.div_(predivide)
        if self.groups.is_sharded:
            output = torch.empty(self.layout.shard_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device)
            work = comm.reduce_scatter(output, unsharded_grad, self.groups.shard_group, async_op=async_op)
            if not comm.inputs_in_use(work):
                # Copied out already (shared memory): the padded gradient is
                # freed now rather than at the wait, one unit's less at peak.
                return PendingCollective(work, output, ())
            return PendingCollective(work, output, (unsharded_grad, computed_grad))
        work = None
        if self.groups.replicate_group is not None:
            work = comm.all_reduce(unsharded_grad, self.groups.replicate_group, async_op=async_op)
        return PendingCollective(work, unsharded_grad, (computed_grad,))

    def _predivide_factor(self) -> float:
        # Low-precision sums can overflow: split the division around the
        # reduction. Full precision divides once afterwards (exact mean).
        world = self.groups.data_parallel_world_size
        if self.reduce_dtype in (torch.float16, torch.bfloat16) and world > 1:
            return float(2 ** round(math.log2(math.sqrt(world))))
        return 1.0

    def finish_grad_reduction(self, reduced: PendingCollective) -> None:
        """Complete a reduction whose work was waited on: reduce over the
        replicate group (hybrid), turn the sum into a mean, accumulate into the
        sharded gradient and point the parameters' ``.grad`` at it."""
        shard_grad = reduced.output
        if self.groups.is_sharded and self.groups.replicate_group is not None:
            comm.all_reduce(shard_grad, self.groups.replicate_group, async_op=False)
        postdivide = self.groups.data_parallel_world_size / self._predivide_factor()
        if postdivide != 1.0:
            shard_grad.div_(postdivide)
        grad_dtype = self.reduce_dtype if self.keep_low_precision_grads else self.layout.dtype
        # Cast where it was reduced (the device); with offload, then download.
        shard_grad = shard_grad.to(grad_dtype)
        existing = self._collect_user_grads()
        if self.offload_params:
            sharded_flat_grad = self._download_grad(shard_grad, existing)
        elif existing is None:
            sharded_flat_grad = shard_grad
        else:
            sharded_flat_grad = existing.add_(shard_grad.to(existing.dtype))
        self.use_sharded_grad_views(sharded_flat_grad)

    def _download_grad(self, shard_grad: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor:
        """CPU offload: the sharded gradient (on the device) into host memory,
        added to ``existing`` (the host gradient to accumulate into), without
        blocking the host.

        [Note: CPU offload copies]
        With ``offload_params`` the fp32 shard lives in pinned host memory and
        only the device computes. Uploads (``_shard_on_compute_device``) copy
        the pinned shard as it is with ``non_blocking=True`` (an asynchronous
        DMA on the lane's stream) and cast on the device afterwards; a cast
        on the host would first write a pageable temporary, whose upload
        blocks the host. Downloads go the other way, on the reduction lane
        after the reduction (the runtime asks the scheduler to finish
        offloaded reductions there, so the copies never hold up backward
        kernels on compute; see "The host is a third party" in
        [Note: lane fences], scheduler.py): the gradient is cast on the
        device, then copied with ``non_blocking=True`` into pinned host
        memory (a new block from the pinned caching allocator, which reuses a
        block only after the copies recorded on it — on the stream current
        at the copy — finished). To accumulate, the host gradient (pinned:
        see ``_collect_user_grads``) is uploaded, summed on the device and
        downloaded into the same host memory, so the ``.grad`` views stay
        valid; all three are on one stream, hence ordered.

        Nothing on the host reads or writes that memory while the device may
        still use it: the gradients' values are undefined until the end of
        backward, where compute waits on the post-reduce fence and the
        runtime makes the host wait once for the compute stream
        (``Scheduler.synchronize_host``), after every fence and download was
        enqueued; the optimizer (on CPU, on the offloaded shards) and
        ``clip_grad_norm_`` run after that. Host writes to the shard
        (optimizer step, state-dict loads, write-back) happen after a
        backward, or after a forward that no backward follows, at whose end
        the runtime waits the same way.
        """
        if existing is None:
            host = torch.empty(shard_grad.shape, dtype=shard_grad.dtype, pin_memory=True)
            return host.copy_(shard_grad, non_blocking=True)
        total = existing.to(shard_grad.device, non_blocking=True).add_(shard_grad.to(existing.dtype))
        return existing.copy_(total, non_blocking=True)

    def _collect_user_grads(self) -> torch.Tensor | None:
        """The sharded gradient to accumulate into, as the user left it.

        [Note: sharded gradient ownership]
        The handle keeps no reference to the sharded gradient: the
        parameters' ``.grad`` views own it, so ``zero_grad()`` (set to None)
        frees it as it would for an unsharded model. To accumulate, the flat
        gradient is recovered from those views when they still tile one
        storage as the layout says (the common case), else rebuilt from
        whatever the user left (assigned tensors copied, cleared ones zero).
        Returns None when every ``.grad`` is None.
        """
        grads = [param.grad for param in self.orig_params]
        present = [(info, grad) for info, grad in zip(self.layout.params, grads) if grad is not None]
        if not present:
            return None
        recovered = self._flat_grad_under_views(grads)
        if recovered is not None:
            return recovered
        dtype = present[0][1].dtype
        device = self.sharded_flat_param.device
        # Offloaded: pinned, as the downloads are, since it becomes the
        # ``.grad`` storage the device copies into without blocking the host
        # ([Note: CPU offload copies]); pageable memory would make every
        # later upload and download of it a blocking copy.
        pin = device.type == "cpu" and self.compute_device.type == "cuda"
        flat_grad = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device, pin_memory=pin)
        with torch.no_grad():
            for info, grad in present:
                if info.local_numel:
                    # Host to host (autograd keeps a ``.grad`` on its
                    # parameter's device: the host when offloaded) or within
                    # the device: never a transfer, nothing to fence.
                    flat_grad[info.shard_offset : info.shard_offset + info.local_numel].copy_(grad.reshape(-1))
        return flat_grad

    def _flat_grad_under_views(self, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The flat sharded gradient that every non-empty ``.grad`` is still a
        view of, at its layout offset; None if they are not (all) such views."""
        tiles = [(info, grad) for info, grad in zip(self.layout.params, grads) if info.local_numel]
        if not tiles or any(grad is None for _, grad in tiles):
            return None
        first = tiles[0][1]
        storage = first.untyped_storage()
        for info, grad in tiles:
            if (
                grad.dtype != first.dtype
                or not grad.is_contiguous()
                or grad.storage_offset() != info.shard_offset
                or grad.untyped_storage().data_ptr() != storage.data_ptr()
            ):
                return None
        if storage.nbytes() < self.layout.shard_numel * first.element_size():
            return None
        flat = torch.empty(0, dtype=first.dtype, device=first.device)
        return flat.set_(storage, 0, (self.layout.shard_numel,))

    def use_sharded_grad_views(self, sharded_flat_grad: torch.Tensor | None) -> None:
        """Set each original parameter's ``.grad`` to its slice of
        ``sharded_flat_grad`` (all None when it is None); frozen parameters'
        ``.grad`` is left alone (see [Note: changes to original parameters]).

        [Note: empty gradients on empty ranges]
        A parameter of which this rank holds no element gets an *empty*
        ``.grad`` (a new 0-element tensor, not a view, so it keeps no storage
        alive), never None: optimizers skip parameters whose ``.grad`` is
        None, so AdamW's ``step`` (and any other per-parameter counter) would
        stop advancing on that rank only, and after a resume the stale value
        could be the one a state dict saves. With an empty ``.grad`` every
        rank's optimizer steps every parameter, and the scalar state agrees
        across ranks whatever the layout. ``_collect_user_grads`` and
        ``clip_grad_norm_`` ignore empty gradients.
        """
        for info, param, requires_grad in zip(self.layout.params, self.orig_params, self.param_requires_grad):
            if not (requires_grad and param.requires_grad):
                continue  # frozen: its .grad stays the user's (see [Note: changes to original parameters])
            if sharded_flat_grad is None:
                param.grad = None
                continue
            if info.local_numel == 0:
                local = sharded_flat_grad.new_empty(0)
            else:
                local = sharded_flat_grad[info.shard_offset : info.shard_offset + info.local_numel]
            if local.dtype == param.dtype:
                param.grad = local
            else:
                self._grad_placeholder = set_grad_of_other_dtype(param, local, self._grad_placeholder)

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle | None:
        """Run ``hook`` once the flat parameter's gradient is accumulated,
        whenever it requires grad, also if that starts after sharding
        (autograd keeps the hook while ``requires_grad`` changes, but refuses
        to register it on a tensor that needs no gradient). None for a flat
        parameter that can never have a gradient (integer dtypes)."""
        flat_param = self.unsharded_flat_param
        if not (flat_param.is_floating_point() or flat_param.is_complex()):
            return None
        requires_grad = flat_param.requires_grad
        flat_param.requires_grad_(True)
        try:
            return flat_param.register_post_accumulate_grad_hook(hook)
        finally:
            flat_param.requires_grad_(requires_grad)

    def clear_unsharded_grad(self) -> None:
        self.unsharded_flat_param.grad = None

    def __repr__(self) -> str:
        return f"FlatParamHandle({self.layout.describe()})"
