"""Owns: the storage of one flat parameter (``FlatParamHandle``): its
sharded and unsharded buffers, the original parameters' views into them,
all-gathering and freeing the unsharded buffer, the full copies of
``unshard_params``, and the mixed-precision and offload copies. It applies
what ``handle.writeback`` finds and hands gradients to ``comm.reduce_grad``
and ``handle.grads``.

Knows nothing of: modules' training state, hooks, streams (collectives are
issued through ``comm`` and returned as ``PendingCollective`` for the
scheduler to wait on).

Public names: ``FlatParamHandle``, ``FlatParamSource``.

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
padded unsharded gradient that ``reduce_grad`` reduces.

When the shard group has one rank and no copy is needed (same dtype, same
device), the unsharded flat parameter shares the shard's storage and nothing
is ever gathered or freed. Pinned by tests/handle/test_flat_param.py
(test_views_alias_flat_storage_and_reshard_frees_unsharded_storage, test_shard_then_unshard_is_bit_exact).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .. import comm
from ..comm import GradReduceSettings, PendingCollective, ShardGroups
from .layout import FlatParamLayout, ParamInfo, ParamOwner, compute_layout
from . import dtensor_views, forward_views, grads, writeback
from .dtensor_views import TensorParallelSpec
from .grad_usage import GradUsage

__all__ = ["FlatParamHandle", "FlatParamSource"]


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
        # Each parameter's tensor-parallel spec (None: a plain tensor); the
        # layout holds DTensors' local tensors ([Note: DTensor parameters]
        # in handle/dtensor_views.py).
        self.tp_specs: tuple[TensorParallelSpec | None, ...] = tuple(
            dtensor_views.tensor_parallel_spec(src.param, src.owners[0].fqn, (groups.shard_group, groups.replicate_group))
            for src in sources
        )
        if keep_low_precision_grads and any(self.tp_specs):
            raise ValueError(
                f"fully_shard: parameter '{sources[0].owners[0].fqn}' and others are DTensors (tensor parallelism); "
                "keep_low_precision_grads=True would give them plain low-precision .grad tensors, which "
                "optimizers cannot combine with DTensor parameters. Use keep_low_precision_grads=False."
            )
        self.layout: FlatParamLayout = compute_layout(
            [(spec.local_shape if spec else src.param.shape, src.owners) for src, spec in zip(sources, self.tp_specs)],
            dtype=first.dtype,
            requires_grad=first.requires_grad,
            shard_rank=groups.shard_rank,
            shard_world_size=groups.shard_world_size,
        )
        # The most one rank writes for this handle's collectives in each
        # group (a reduce-scatter writes every chunk but its own, an
        # all-reduce the whole tensor, a bucket of reductions up to
        # ``comm.REDUCE_BUCKET_BYTES``: [Note: coalesced reductions] in
        # runtime/grad_buckets.py): the shared memory of the group is checked
        # and reserved for it (see [Note: one transport per group] in
        # comm/transport.py). ``plan`` counts the same (planning/transport_memory.py).
        most = comm.collective_bytes_per_group(
            shard_world_size=groups.shard_world_size if groups.is_sharded else 1,
            has_replicas=groups.replicate_group is not None,
            shard_numel=self.layout.shard_numel,
            dtypes=(first.dtype, param_dtype or first.dtype),
            reduce_dtype=reduce_dtype or first.dtype,
            requires_grad=first.requires_grad,
            offload=offload_params,
        )
        for kind, group in (("shard", groups.shard_group), ("replicate", groups.replicate_group)):
            if kind in most:
                comm.expect_collective_bytes(group, most[kind])
        # The user's parameter objects, in layout order; identity is kept.
        self.orig_params: tuple[nn.Parameter, ...] = tuple(src.param for src in sources)
        # Device forward and backward run on (where the unsharded buffer lives).
        self.compute_device = compute_device
        # The mixed-precision policy's dtypes (None: follow the parameters'
        # dtype, also after a cast; see [Note: changes to original parameters]
        # in handle/writeback.py).
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
        # What DTensor parameters show between steps (None for plain ones).
        self._shard_shells: tuple[DTensor | None, ...] = ()
        self._shard_views_of: torch.Tensor | None = None
        # The layout as the views read it (``_forward_view_plan``), and the views the last forward
        # showed, for its backward ([Note: forward views reused in backward] in handle/forward_views.py).
        self._view_plan: forward_views.ViewPlan | None = None
        self._forward_views: forward_views.ShownViews | None = None
        # What the owners were last shown in place of the originals (None: the originals).
        self._shown: tuple[forward_views.Registration, ...] | None = None
        self.grad_usage = GradUsage()  # which parameters backwards reach
        # 0-dim, the parameters' dtype, on the shard's device: the storage
        # every low-precision ``.grad`` is first assigned as a view of
        # (``set_grad_of_other_dtype``); None until the first one.
        self._grad_placeholder: torch.Tensor | None = None
        # The unit's reduction overrides (set by its state; None: defaults),
        # the settings of the reduction in flight (issued with them), and the
        # partial sum kept while the replica all-reduce is skipped ([Note:
        # partial sums without the replica all-reduce] in comm/overrides.py).
        self.reduction_overrides: comm.ReductionOverrides | None = None
        self._base_settings: GradReduceSettings | None = None  # reduction_settings' last, overrides aside
        self._settings_in_flight: GradReduceSettings | None = None
        self.partial_reduced_grad: torch.Tensor | None = None
        self.use_sharded_views()

    # ------------------------------------------------------------------ init
    def _build_shard(self, device: torch.device) -> torch.Tensor:
        layout = self.layout
        shard = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=device)
        with torch.no_grad():
            for info, param in zip(layout.params, self.orig_params):
                if info.local_numel:
                    local = dtensor_views.local_tensor(param).detach().reshape(-1)[info.local_start : info.local_start + info.local_numel]
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
            self._shard_shells = tuple(
                dtensor_views.range_dtensor(view, spec) if spec is not None else None
                for view, spec in zip(self._shard_views, self.tp_specs)
            )
            self._shard_views_of = self.sharded_flat_param
        for param, view, shell in zip(self.orig_params, self._shard_views, self._shard_shells):
            if shell is None:
                param.data = view
            else:
                dtensor_views.show_local(param, shell)
        self._register_orig_params()

    def show_local_data(self, index: int, local: torch.Tensor, *, full: bool = False) -> None:
        """Point parameter ``index``'s data at ``local`` (``dtensor_views.show_local_data``)."""
        dtensor_views.show_local_data(self.orig_params[index], self.tp_specs[index], local, full=full)

    def _register_orig_params(self) -> None:
        """Register the original parameters back on their owners (their
        ``.data`` is left as it is); raises on one replaced during the step
        ([Note: a parameter replaced during a step] in handle/forward_views.py)."""
        shown, self._shown = self._shown, None
        self.shows_unsharded_views = False
        forward_views.take_back_owners(self._forward_view_plan(), shown, give_back=True)

    def hide_unsharded_views(self) -> None:
        """Show the owners the original parameters (the shard) again and
        keep the unsharded buffer gathered: a unit held for its backward
        (see [Note: held for backward] in runtime/lifecycle.py); ``reshard`` frees it."""
        self._register_orig_params()

    def use_unsharded_views(self) -> None:
        """Give the owners autograd views of the unsharded flat parameter
        (forward and backward), so gradients flow into its ``.grad``.

        Cut anew at every call (the pre-backward after a forward may show
        that forward's instead: ``reuse_forward_views``): the autograd engine
        runs ready nodes newest first, and views kept from the first step
        would put their split's backward (and so this flat parameter's
        post-accumulate-grad hook, which reduces and frees the gradient)
        behind every node of later steps, i.e. at the end of backward."""
        self.check_unsharded("use_unsharded_views")
        plan = self._forward_view_plan()
        flat = self.unsharded_flat_param
        forward_views.take_back_owners(plan, self._shown, give_back=False)
        shown = self._shown = forward_views.show_new_views(plan, flat, self.param_requires_grad, self.tp_specs, self.grad_usage)
        self._forward_views = None
        # Not kept under inference mode, nor while dynamo traces (the query
        # would break the graph; the record is only a saving).
        if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
            storage = forward_views.storage_key(flat)
            self._forward_views = forward_views.ShownViews(plan, self.param_requires_grad, storage, shown)
        self.shows_unsharded_views = True

    def reuse_forward_views(self) -> bool:
        """Show the owners the views the last ``use_unsharded_views`` cut,
        where they are still what it would cut now (a pre-backward after its
        forward: [Note: forward views reused in backward] in
        handle/forward_views.py); returns whether it did."""
        shown = self._forward_views
        if shown is None or not self.is_unsharded:
            return False
        if not shown.still_valid(self._forward_view_plan(), self.param_requires_grad, self.unsharded_flat_param):
            return False
        forward_views.take_back_owners(shown.plan, self._shown, give_back=False)
        shown.show()
        self._shown = shown.registrations
        self.shows_unsharded_views = True
        return True

    def _forward_view_plan(self) -> forward_views.ViewPlan:
        """The layout as the views read it; rebuilt when the layout object
        changes (a dtype change replaces it). A unit's forward and backward
        each show views and each reshard registers the parameters back,
        so this is read several times per unit per step."""
        plan = self._view_plan
        if plan is None or plan.layout is not self.layout:
            plan = self._view_plan = forward_views.view_plan_of(self.layout, self.orig_params)
        return plan

    # ------------------------------------------------------ unshard/reshard
    def unshard(self, *, async_op: bool) -> PendingCollective | None:
        """Allocate the unsharded buffer and start filling it from every
        rank's shard; returns the pending all-gather (None: nothing to wait
        for). The views change at ``use_unsharded_views``, after it."""
        if self.is_unsharded:
            return None
        output = self.allocate_unsharded()
        if not self.groups.is_sharded:
            # The shard is the whole flat parameter: copied in (uploaded first
            # where a cast is needed, so the cast runs on the device); the
            # lane's work, fenced like a collective ([Note: lane fences]).
            shard = self.sharded_flat_param
            if shard.dtype != output.dtype:
                shard = self.shard_on_compute_device()
            output.copy_(shard, non_blocking=True)
            return None
        source = self._all_gather_source()
        work = comm.all_gather_into(output, source, self.groups.shard_group, async_op=async_op)
        return PendingCollective(work, output, (source,))

    def allocate_unsharded(self) -> torch.Tensor:
        """Allocate the unsharded buffer for an all-gather about to fill it
        (``unshard``'s, or a coalesced one's) and return it: unsharded now."""
        flat = self.unsharded_flat_param
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self.is_unsharded = True
        # ``.data``: autograd's version counter must not see the write
        # (tensors saved for backward alias this storage on purpose).
        return self.unsharded_flat_param.data

    def shard_on_compute_device(self) -> torch.Tensor:
        """The shard in its own dtype on the compute device. With CPU offload,
        a temporary uploaded from the pinned shard without blocking the host
        (see [Note: CPU offload copies] in handle/grads.py); else the shard itself."""
        shard = self.sharded_flat_param
        if shard.device == self.compute_device:
            return shard
        return shard.to(self.compute_device, non_blocking=True)

    def _all_gather_source(self) -> torch.Tensor:
        """The shard as the all-gather reads it: on the compute device, in the
        compute dtype (a temporary when either differs; the cast runs on the
        device, after the upload)."""
        return self.shard_on_compute_device().to(self.param_dtype)

    def reshard(self, *, free_storage: bool = True) -> None:
        """Show the shard again and free the unsharded buffer's storage; with
        ``free_storage=False`` the storage stays allocated until
        ``free_unsharded_storage`` (the scheduler decides when its block may
        be reused: [Note: what a lane waits for] in runtime/scheduler.py).
        Only the owners' registrations are restored: the parameters'
        ``.data`` is the shard's views already (only ``show_full_params``
        and the user change it, and the root's pre-forward or
        ``unshard_params`` put it back)."""
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

    def check_unsharded(self, what: str) -> None:
        if not self.is_unsharded:
            names = ", ".join(info.fqn for info in self.layout.params[:3])
            raise RuntimeError(f"FlatParamHandle({names}, ...): {what} needs the handle unsharded; call unshard() first")


    # ----------------------------------------------------------- write-back
    def writeback_orig_params(self, *, name_prefix: str = "") -> bool:
        """Take in what the user changed on the original parameters since the
        last call: ``requires_grad``, a dtype cast, and ``.data`` assigned
        (same numel, or the full shape) or cast, copied into the shard. See
        [Note: changes to original parameters] in handle/writeback.py.
        Returns whether any value was written back. Raises on a change that
        cannot be taken (a replaced parameter object, a changed size, part of
        the flat parameter cast, a ``requires_grad`` change while a
        ``no_sync`` gradient waits) before changing anything;
        ``name_prefix`` (the unit's name and a dot) completes parameter names
        in messages. Skipped while forward views are shown (between a forward
        and its backward the parameters are not the user's to edit)."""
        if self.shows_unsharded_views:
            return False
        edits, requires_grad = writeback.find_user_edits(self, name_prefix=name_prefix)
        if not edits and requires_grad == self.param_requires_grad:
            return False
        if torch.is_inference_mode_enabled():
            # What is built below (a new shard, buffer, views) outlives the
            # forward that may run this under torch.inference_mode(): never
            # inference tensors (test_loop_recovery.py). Leaving inference
            # mode turns grad mode on: off again, as it was.
            with torch.inference_mode(False), torch.set_grad_enabled(False):
                return self._apply_user_edits(edits, requires_grad, name_prefix)
        return self._apply_user_edits(edits, requires_grad, name_prefix)

    def _apply_user_edits(self, edits: list, requires_grad: tuple[bool, ...], name_prefix: str) -> bool:
        # A cast gives every parameter it changes new storage: only edited
        # parameters can have another dtype.
        cast = any(edit.param.dtype != self.layout.dtype for edit in edits)
        dtype = writeback.common_cast_dtype(self.layout, self.orig_params, name_prefix=name_prefix) if cast else None
        if requires_grad != self.param_requires_grad:
            self._set_requires_grad(requires_grad, name_prefix)
        if dtype is not None:
            self._change_dtype(dtype)
        if not edits:
            return False
        with torch.no_grad():
            for info, _param, local in edits:
                if local is not None:
                    self.local_shard_view(info).copy_(local)
                self.show_local_data(self.layout.params.index(info), self.local_shard_view(info))
        return any(edit.local is not None for edit in edits)

    def _set_requires_grad(self, requires_grad: tuple[bool, ...], name_prefix: str) -> None:
        writeback.check_requires_grad_change(
            self.layout,
            self.param_requires_grad,
            requires_grad,
            grad_waits=self.unsharded_flat_param.grad is not None,
            name_prefix=name_prefix,
        )
        self.param_requires_grad = requires_grad
        self.ever_required_grad = self.ever_required_grad or self.requires_grad
        self.unsharded_flat_param.requires_grad_(self.requires_grad)

    def _change_dtype(self, dtype: torch.dtype) -> None:
        """Give the flat parameter ``dtype``, keeping its layout's offsets
        (see [Note: changes to original parameters] in handle/writeback.py).
        The shard starts as a cast of the old one (padding, empty parts); the
        caller copies the parameters' values in."""
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


    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each original parameter's view (original shape) of a padded
        unsharded flat tensor."""
        segments = torch.split(flat.detach(), list(self.layout.split_sizes))
        return [segments[index].view(info.shape) for info, index in zip(self.layout.params, self.layout.param_segments)]


    # ------------------------------------------------------------- gradients
    def has_unsharded_grad(self) -> bool:
        return self.unsharded_flat_param.grad is not None

    def reduction_settings(self) -> GradReduceSettings:
        """How the next reduction runs: built per reduction (a dtype change
        in write-back changes the dtypes), with the unit's overrides."""
        grad_dtype = self.reduce_dtype if self.keep_low_precision_grads else self.layout.dtype
        settings = self._base_settings  # frozen: reused while built from the same
        if (
            settings is None
            or settings.groups is not self.groups
            or settings.reduce_dtype != self.reduce_dtype
            or settings.grad_dtype != grad_dtype
        ):
            settings = self._base_settings = GradReduceSettings(self.groups, self.reduce_dtype, grad_dtype)
        return comm.settings_with(settings, self.reduction_overrides)

    def reduce_grad(self, *, async_op: bool) -> PendingCollective | None:
        """Start reducing the padded unsharded gradient over the shard group
        (reduce-scatter) or, unsharded, over the replicate group
        (all-reduce): ``comm.reduce_grad``. The unsharded gradient is
        released from the flat parameter; the returned pending collective
        keeps it alive."""
        taken = self.take_grad_for_reduction()
        if taken is None:
            return None
        unsharded_grad, settings = taken
        return comm.reduce_grad(unsharded_grad, settings, async_op=async_op, carried=self.partial_reduced_grad)

    def take_grad_for_reduction(
        self, settings: GradReduceSettings | None = None
    ) -> tuple[torch.Tensor, GradReduceSettings] | None:
        """The padded unsharded gradient, released from the flat parameter,
        and how to reduce it (``settings``, or ``reduction_settings()``; kept
        for ``finish_grad_reduction``); None when there is none.
        ``reduce_grad`` runs it; a coalesced reduction ([Note: coalesced
        reductions] in runtime/grad_buckets.py) takes several handles' and
        reduces them in one collective."""
        unsharded_grad = self.unsharded_flat_param.grad
        if unsharded_grad is None:
            return None
        self.unsharded_flat_param.grad = None
        if settings is None:
            settings = self.reduction_settings()
        self._settings_in_flight = settings
        return unsharded_grad, settings

    def finish_grad_reduction(self, reduced: PendingCollective) -> bool:
        """Complete a reduction whose work was waited on: the mean shard
        (``comm.finish_grad_reduction``: the hybrid replicate all-reduce, the
        division, the cast to the gradient dtype) is accumulated into the
        sharded gradient, and the parameters' ``.grad`` point at it. Returns
        False where the replica all-reduce was skipped: the partial sum is
        kept and ``.grad`` is unchanged."""
        settings, self._settings_in_flight = self._settings_in_flight or self.reduction_settings(), None
        shard_grad, self.partial_reduced_grad = comm.finish_grad_reduction(
            reduced, settings, carried=self.partial_reduced_grad
        )
        if shard_grad is None:
            return False
        existing = self.collect_user_grads()
        if self.offload_params:
            sharded_flat_grad = self._download_grad(shard_grad, existing)
        else:
            sharded_flat_grad = grads.accumulate_grad(shard_grad, existing)
        self.use_sharded_grad_views(sharded_flat_grad)
        return True

    def _download_grad(self, shard_grad: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor:
        # A method (tests wrap it per handle to see where downloads run).
        return grads.download_grad(shard_grad, existing)

    def collect_user_grads(self) -> torch.Tensor | None:
        device = self.sharded_flat_param.device
        pin = device.type == "cpu" and self.compute_device.type == "cuda"
        return grads.collect_user_grads(self.layout, self.orig_params, device=device, pin=pin)

    def use_sharded_grad_views(self, sharded_flat_grad: torch.Tensor | None) -> None:
        """Set each original parameter's ``.grad`` to its slice of
        ``sharded_flat_grad`` (all None when it is None); see
        ``handle.grads.use_sharded_grad_views``."""
        self._grad_placeholder = grads.use_sharded_grad_views(
            self.layout,
            self.orig_params,
            self.param_requires_grad,
            sharded_flat_grad,
            placeholder=self._grad_placeholder,
        )

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
        """Drop the gradients not reduced yet: the unsharded one and the
        partial sum of skipped all-reduces (a reset after an error)."""
        self.unsharded_flat_param.grad = None
        self.partial_reduced_grad = None

    def __repr__(self) -> str:
        return f"FlatParamHandle({self.layout.describe()})"
