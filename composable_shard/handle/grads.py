"""Owns: a flat parameter's sharded gradient once reduced: collecting what
the user left in the parameters' ``.grad``, accumulating the reduced shard
into it (on the host with CPU offload), and pointing every parameter's
``.grad`` at its slice.

Knows nothing of: how the gradient was reduced (``comm.reduce_grad``),
the unsharded buffer and its views (``handle.storage``), modules' training
state, hooks, streams (the scheduler decides where these copies run).

Public names: ``set_grad_of_other_dtype``, ``collect_user_grads``,
``accumulate_grad``, ``download_grad``, ``use_sharded_grad_views``,
``refuse_grad_dtype``.

[Note: a parameter's grad_dtype]
torch 2.11 gave leaf tensors ``grad_dtype``: the dtype autograd casts their
gradients to (``None``: whatever dtype arrives), by default their own and
following their casts. A flat parameter's gradient is of its dtype (or the
mixed-precision policy's), reduced and accumulated so; a parameter's
``.grad`` is a view of it. A ``grad_dtype`` set to anything else was not
honoured: a float32 one on a bfloat16 parameter made backward and
``unshard_params(with_grads=True)`` raise torch's "attempting to assign a
gradient with dtype", and ``None`` silently accumulated a custom
``autograd.Function``'s float32 gradients in bfloat16 (FSDP2's
test_fully_shard_conversion.py). So ``fully_shard`` refuses such a
parameter by name (units/param_kinds.py), and so does the next forward when
it was set later (handle/writeback.py), naming what gives the dtypes
wanted: float32 parameters with ``MixedPrecision(param_dtype=...)``.
Pinned by tests/runtime/test_errors.py
(test_a_grad_dtype_other_than_the_parameters_is_refused_by_name).

[Note: sharded gradient ownership]
The handle keeps no reference to the sharded gradient: the parameters'
``.grad`` views own it, so ``zero_grad()`` (set to None) frees it as it
would for an unsharded model. To accumulate, the flat gradient is recovered
from those views when they still tile one storage as the layout says (the
common case), else rebuilt from whatever the user left (assigned tensors
copied, cleared ones zero). Pinned by
test_gradient_reduction_is_the_mean_and_accumulates (tests/handle/test_flat_param.py)
and test_no_sync_between_synchronised_backwards_and_nested_use
(test_no_sync.py).

[Note: empty gradients on empty ranges]
A parameter of which this rank holds no element gets an *empty* ``.grad``
(a new 0-element tensor, not a view, so it keeps no storage alive; one
per parameter: ``nn.Module._apply`` swaps each ``.grad``, which refuses a
tensor held elsewhere), never
None: optimizers skip parameters whose ``.grad`` is None, so AdamW's
``step`` (and any other per-parameter counter) would stop advancing on that
rank only, and after a resume the stale value could be the one a state dict
saves. With an empty ``.grad`` every rank's optimizer steps every
parameter, and the scalar state agrees across ranks whatever the layout.
``collect_user_grads`` and ``clip_grad_norm_`` ignore empty gradients.
Pinned by test_frozen_empty_local_parts_and_low_precision_grads
(test_clip_grad_norm.py).

[Note: CPU offload copies]
With ``offload_params`` the fp32 shard lives in pinned host memory and only
the device computes. Uploads (the handle's ``_shard_on_compute_device``)
copy the pinned shard as it is with ``non_blocking=True`` (an asynchronous
DMA on the lane's stream) and cast on the device afterwards; a cast on the
host would first write a pageable temporary, whose upload blocks the host.
Downloads (``download_grad``) go the other way, on the reduction lane after
the reduction (the runtime asks the scheduler to finish offloaded
reductions there, so the copies never hold up backward kernels on compute;
see "The host is a third party" in [Note: lane fences], runtime/scheduler.py): the
gradient is cast on the device, then copied with ``non_blocking=True`` into
pinned host memory (a new block from the pinned caching allocator, which
reuses a block only after the copies recorded on it finished). To
accumulate, the host gradient (pinned: see ``collect_user_grads``) is
uploaded, summed on the device and downloaded into the same host memory, so
the ``.grad`` views stay valid; all three are on one stream, hence ordered.

Nothing on the host reads or writes that memory while the device may still
use it: the gradients' values are undefined until the end of backward,
where compute waits on the post-reduce fence and the runtime makes the host
wait once for the compute stream (``Scheduler.synchronize_host``), after
every fence and download was enqueued; the optimizer and
``clip_grad_norm_`` run after that. Host writes to the shard (optimizer
step, state-dict loads, write-back) happen after a backward, or after a
forward that no backward follows, at whose end the runtime waits the same
way. Pinned by tests/cuda/test_offload_fences.py and
tests/scheduler/test_cuda_offload.py (CUDA).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .layout import FlatParamLayout, ParamInfo
from .dtensor_views import as_grad_of, local_tensor

__all__ = [
    "set_grad_of_other_dtype",
    "collect_user_grads",
    "accumulate_grad",
    "download_grad",
    "use_sharded_grad_views",
    "refuse_grad_dtype",
]

# Leaf tensors have ``grad_dtype`` from torch 2.11 ([Note: a parameter's grad_dtype]).
_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def refuse_grad_dtype(param: torch.Tensor, fqn: str, name: str | None = None, *, prefix: str = "") -> None:
    """Raise, naming ``prefix + fqn`` (in ``fully_shard(name)`` where
    given), if ``param``'s ``grad_dtype`` is not its dtype ([Note: a
    parameter's grad_dtype]). Read for every parameter at every root
    forward: the name is only put together to raise."""
    if not _HAS_GRAD_DTYPE or param.grad_dtype == param.dtype:
        return
    wanted = "None (any dtype)" if param.grad_dtype is None else str(param.grad_dtype)
    raise ValueError(
        f"fully_shard{'' if name is None else f'({name})'}: parameter '{prefix}{fqn}' has grad_dtype {wanted}, other than its dtype "
        f"{param.dtype}; its gradient is a view of its flat parameter's, which has the parameter's dtype "
        "(or the mixed-precision policy's). For float32 gradients of low-precision compute, keep the "
        "parameters in float32 and pass mixed_precision=MixedPrecision(param_dtype=torch.bfloat16). Set "
        "param.grad_dtype = param.dtype to go on."
    )


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


def collect_user_grads(
    layout: FlatParamLayout, orig_params: Sequence[nn.Parameter], *, device: torch.device, pin: bool
) -> torch.Tensor | None:
    """The sharded gradient to accumulate into, as the user left it (see
    [Note: sharded gradient ownership]): the flat gradient under the
    parameters' ``.grad`` views, or one rebuilt on ``device`` (pinned host
    memory with ``pin``). None when every ``.grad`` is None."""
    grads = [None if param.grad is None else local_tensor(param.grad) for param in orig_params]
    present = [(info, grad) for info, grad in zip(layout.params, grads) if grad is not None]
    if not present:
        return None
    recovered = _flat_grad_under_views(layout, grads)
    if recovered is not None:
        return recovered
    dtype = present[0][1].dtype
    # Offloaded: pinned, as the downloads are, since it becomes the
    # ``.grad`` storage the device copies into without blocking the host
    # ([Note: CPU offload copies]); pageable memory would make every later
    # upload and download of it a blocking copy.
    flat_grad = torch.zeros(layout.shard_numel, dtype=dtype, device=device, pin_memory=pin)
    with torch.no_grad():
        for info, grad in present:
            if info.local_numel:
                # Host to host (autograd keeps a ``.grad`` on its parameter's
                # device: the host when offloaded) or within the device:
                # never a transfer, nothing to fence.
                flat_grad[info.shard_offset : info.shard_offset + info.local_numel].copy_(grad.reshape(-1))
    return flat_grad


def _flat_grad_under_views(layout: FlatParamLayout, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The flat sharded gradient that every non-empty ``.grad`` is still a
    view of, at its layout offset; None if they are not (all) such views."""
    tiles: list[tuple[ParamInfo, torch.Tensor]] = []
    for info, grad in zip(layout.params, grads):
        if info.local_numel:
            if grad is None:
                return None
            tiles.append((info, grad))
    if not tiles:
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
    if storage.nbytes() < layout.shard_numel * first.element_size():
        return None
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    return flat.set_(storage, 0, (layout.shard_numel,), (1,))


def accumulate_grad(shard_grad: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor:
    """The reduced ``shard_grad`` added to ``existing`` (in place, in its
    dtype), or ``shard_grad`` itself when there is nothing to add to."""
    if existing is None:
        return shard_grad
    return existing.add_(shard_grad.to(existing.dtype))


def download_grad(shard_grad: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor:
    """CPU offload: the sharded gradient (on the device) into pinned host
    memory, added to ``existing`` (the host gradient to accumulate into),
    without blocking the host (see [Note: CPU offload copies])."""
    if existing is None:
        host = torch.empty(shard_grad.shape, dtype=shard_grad.dtype, pin_memory=True)
        return host.copy_(shard_grad, non_blocking=True)
    total = existing.to(shard_grad.device, non_blocking=True).add_(shard_grad.to(existing.dtype))
    return existing.copy_(total, non_blocking=True)


def use_sharded_grad_views(
    layout: FlatParamLayout,
    orig_params: Sequence[nn.Parameter],
    param_requires_grad: Sequence[bool],
    sharded_flat_grad: torch.Tensor | None,
    *,
    placeholder: torch.Tensor | None,
) -> torch.Tensor | None:
    """Set each original parameter's ``.grad`` to its slice of
    ``sharded_flat_grad`` (all None when it is None; empty on empty ranges:
    [Note: empty gradients on empty ranges]); frozen parameters' ``.grad``
    is left alone (see [Note: changes to original parameters] in
    handle/writeback.py). Returns the placeholder low-precision gradients
    were assigned through (``set_grad_of_other_dtype``), for the next call."""
    if sharded_flat_grad is None:
        for param, requires_grad in zip(orig_params, param_requires_grad):
            if requires_grad and param.requires_grad:  # frozen: its .grad stays the user's
                param.grad = None
        return placeholder
    sizes, segments = layout.shard_split
    # One split cuts every local part (a slice per parameter costs more);
    # split_with_sizes: torch.split without its Python layer.
    parts = sharded_flat_grad.split_with_sizes(sizes)
    for segment, param, requires_grad in zip(segments, orig_params, param_requires_grad):
        if not (requires_grad and param.requires_grad):
            continue  # frozen: its .grad stays the user's
        local = sharded_flat_grad.new_empty(0) if segment is None else parts[segment]
        if local.dtype == param.dtype:
            param.grad = as_grad_of(param, local)
        else:
            placeholder = set_grad_of_other_dtype(param, local, placeholder)
    return placeholder
