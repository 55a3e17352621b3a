"""Owns: getting a unit's parameters and buffers ready to flatten —
materialising a module built on the meta device, moving a CPU-built unit to
the compute device, making every rank start from rank 0's parameters and
buffers, and casting buffers to the mixed-precision ``buffer_dtype``.

Knows nothing of: flat parameters, hooks.

Public names: ``check_materializable``, ``materialize_unit``,
``sync_unit_states``, ``cast_unit_buffers``.

[Note: deferred initialisation]
``fully_shard`` calls these once per unit, children before parents, and
builds the unit's flat parameter (which keeps only this rank's shard and
drops the unsharded tensors) before it turns to the next unit. So the
unsharded model never exists on one rank: peak parameter memory while
sharding is the shards built so far plus one unit unsharded (and its shard).

Within a unit, modules are materialised in pre-order (the unit's module
first, never entering nested units or ignored modules), each by
``param_init_fn(module)`` or else ``module.reset_parameters()``, right after
its own meta tensors got storage. Materialising keeps every ``nn.Parameter``
object (``torch.utils.swap_tensors``): ``fully_shard`` planned ownership on
those objects, tied parameters stay tied, and optimizers built on the meta
model keep pointing at the right tensors. The random numbers drawn therefore
come in that order, which differs from building the model eagerly on one
device; ``sync_module_states=True`` makes the result independent of each
rank's random state (each unit's data-parallel ranks take their first
one's values). Meta buffers get uninitialised storage: the init
function must fill them (``reset_parameters`` of the norms does). Pinned by
tests/runtime/test_deferred_init.py.

[Note: tensors an init left unwritten]
New storage holds whatever memory held. A floating-point tensor given
storage here is filled with NaN first; one the init function left NaN
anywhere raises, naming it. Before, an init that skipped a tensor left
garbage silently: FSDP1's style of ``param_init_fn`` (act only on meta
tensors: ``to_empty``, then ``reset_parameters``) did nothing here, since
the tensors have storage by then, and training started from uninitialised
memory (values up to 7e28, FSDP1's test_fsdp_meta). Integer tensors are not
checked (no value marks them). Pinned by tests/runtime/test_deferred_init.py
(test_an_init_that_leaves_a_tensor_unwritten_is_refused_by_name).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from .. import comm
from ..api import MixedPrecision
from ..comm.groups import ShardGroups
from ..handle import FlatParamSource
from ..handle.dtensor_views import local_tensor

__all__ = ["check_materializable", "materialize_unit", "sync_unit_states", "cast_unit_buffers"]

logger = logging.getLogger(__name__)


def _unit_modules(
    unit: nn.Module, skip: Callable[[nn.Module], bool], prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """The unit's module and its descendants with their names relative to
    the unit, pre-order, not entering nested units or ignored modules."""
    yield prefix, unit
    for name, child in unit.named_children():
        if not skip(child):
            yield from _unit_modules(child, skip, f"{prefix}{name}.")


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)


def check_materializable(
    root: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, skip: Callable[[nn.Module], bool]
) -> None:
    """Raise before anything is changed if a module under ``root`` (outside
    units sharded earlier and ignored modules) holds meta tensors and nothing
    can initialise them."""
    if param_init_fn is not None:
        return
    for prefix, module in _unit_modules(root, skip):
        if not callable(getattr(module, "reset_parameters", None)) and any(t.is_meta for t in _own_tensors(module)):
            raise ValueError(_no_init_message(prefix.rstrip(".") or "<root>", type(module).__name__))


def _no_init_message(fqn: str, class_name: str) -> str:
    return (
        f"fully_shard: module '{fqn}' ({class_name}) was built on the meta device but has no "
        "reset_parameters(); pass param_init_fn=... to fully_shard to initialise it (it is called once per "
        "module, after the module's own tensors got storage on the compute device)."
    )


def materialize_unit(
    unit: nn.Module,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    skip: Callable[[nn.Module], bool],
    name: str = "",
) -> None:
    """Give meta tensors real storage on ``device`` and initialise them
    (``param_init_fn(module)``, else ``module.reset_parameters()``); move
    tensors on another device to ``device``. Parameter objects are kept;
    ``name``: the unit's path in the module given to ``fully_shard``, for
    messages. See [Note: deferred initialisation]."""
    for prefix, module in _unit_modules(unit, skip, f"{name}." if name else ""):
        tensors = list(_own_tensors(module))
        if any(t.is_meta for t in tensors):
            _materialize_module(module, prefix.rstrip(".") or "<root>", device, param_init_fn=param_init_fn)
        elif any(t.device != device for t in tensors):
            _move_module(module, device)


def _materialize_module(
    module: nn.Module, fqn: str, device: torch.device, *, param_init_fn: Callable[[nn.Module], None] | None
) -> None:
    name = type(module).__name__
    if param_init_fn is None and not callable(getattr(module, "reset_parameters", None)):
        raise ValueError(_no_init_message(fqn, name))  # check_materializable normally caught it
    materialized: list[str] = []  # [Note: tensors an init left unwritten]
    for attr, param in module._parameters.items():
        if param is not None and param.is_meta:
            _materialize_param(param, device, name)
            _mark_unwritten(param)
            materialized.append(attr)
    for attr, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[attr] = _mark_unwritten(torch.empty_like(buffer, device=device))
            materialized.append(attr)
    params_before = dict(module._parameters)
    with torch.no_grad():
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            module.reset_parameters()  # type: ignore[operator]  # checked callable above
    _restore_param_identity(module, params_before, device)
    left = [attr for attr, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]
    if left:
        raise ValueError(
            f"fully_shard: after initialising {name}, {left} are still on the meta device. Make "
            "param_init_fn (or reset_parameters) give every parameter and buffer of the module real values."
        )
    tensors = {**module._parameters, **module._buffers}
    unwritten = [
        attr
        for attr in materialized
        if (tensor := tensors.get(attr)) is not None and _can_mark_unwritten(tensor) and bool(tensor.isnan().any())
    ]
    if unwritten:
        how = "param_init_fn(module)" if param_init_fn is not None else f"{name}.reset_parameters()"
        raise ValueError(
            f"fully_shard: module '{fqn}' ({name}) was built on the meta device, and {how} left {unwritten} "
            "(partly) unwritten: they would hold uninitialised memory. fully_shard calls it after the module's "
            "own tensors got storage on the compute device, so they are no longer on meta: an init written for "
            "FSDP1 that acts only on meta tensors (to_empty, then reset_parameters) does nothing here. Initialise "
            "every parameter and buffer unconditionally, e.g. param_init_fn=lambda m: m.reset_parameters()."
        )


def _can_mark_unwritten(tensor: torch.Tensor) -> bool:
    """Whether NaN can mark ``tensor``'s elements as not yet written:
    floating point (an init gives no NaN; integer tensors are not checked)."""
    return tensor.is_floating_point() or tensor.is_complex()


def _mark_unwritten(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, filled with NaN where NaN can mark it ([Note: tensors an
    init left unwritten])."""
    if _can_mark_unwritten(tensor):
        with torch.no_grad():
            tensor.fill_(float("nan"))
    return tensor


def _materialize_param(param: nn.Parameter, device: torch.device, module_name: str) -> None:
    """Give a meta parameter storage on ``device`` in place (same object)."""
    real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)
    try:
        torch.utils.swap_tensors(param, real)
    except RuntimeError as error:
        raise RuntimeError(
            f"fully_shard: cannot materialise a meta parameter of {module_name} in place ({error}). Do not "
            "hold other references (weak references, views) to meta parameters when calling fully_shard."
        ) from error


def _restore_param_identity(
    module: nn.Module, params_before: dict[str, nn.Parameter | None], device: torch.device
) -> None:
    """An init function may replace parameters (``to_empty``, assigning a
    new ``nn.Parameter``): keep the original objects, with the new values."""
    for attr, before in params_before.items():
        after = module._parameters.get(attr)
        if before is None or after is None or after is before:
            continue
        if after.shape != before.shape or after.dtype != before.dtype:
            raise ValueError(
                f"fully_shard: param_init_fn replaced {type(module).__name__}.{attr} of shape "
                f"{tuple(before.shape)} ({before.dtype}) with shape {tuple(after.shape)} ({after.dtype}). "
                "Initialise parameters in place and keep their shape and dtype."
            )
        with torch.no_grad():
            before.data = after.detach().to(device)
        module._parameters[attr] = before


def _move_module(module: nn.Module, device: torch.device) -> None:
    """Move a module's own parameters (same objects) and buffers to ``device``."""
    with torch.no_grad():
        for param in module._parameters.values():
            if param is not None and param.device != device:
                param.data = param.data.to(device)
                if param.grad is not None:
                    param.grad = param.grad.to(device)
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[attr] = buffer.to(device)


def sync_unit_states(
    unit: nn.Module,
    sources: Sequence[FlatParamSource],
    skip: Callable[[nn.Module], bool],
    groups: ShardGroups,
) -> None:
    """Overwrite the unit's parameters and buffers with those of its first
    data-parallel rank (group rank 0 of the shard group, then of the
    replicate group: every rank of ``groups`` ends with that one's values).

    Only the unit's own groups: with tensor parallelism they join the ranks
    that hold the same slice of each ``DTensor`` (whose local tensors are
    broadcast), and ranks outside them (other pipeline stages, other
    tensor-parallel slices) hold other tensors."""
    tensors = [local_tensor(source.param).data for source in sources]
    for _, module in _unit_modules(unit, skip):
        tensors += [local_tensor(buffer) for buffer in module._buffers.values() if buffer is not None]
    with torch.no_grad():
        for group in (groups.shard_group, groups.replicate_group):
            if group is None:
                continue
            for tensor in tensors:
                comm.broadcast(tensor, 0, group)


def cast_unit_buffers(
    unit: nn.Module,
    mixed_precision: MixedPrecision | None,
    skip: Callable[[nn.Module], bool],
) -> dict[str, torch.dtype]:
    """Cast the unit's floating-point buffers (not those of nested units or
    ignored modules) to ``mixed_precision.buffer_dtype`` in place (same
    tensor objects). Returns each cast buffer's original dtype by its name
    relative to the unit, so full state dicts can give the original dtype."""
    buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
    if buffer_dtype is None:
        return {}
    orig_dtypes: dict[str, torch.dtype] = {}
    with torch.no_grad():
        for prefix, module in _unit_modules(unit, skip):
            for attr, buffer in module._buffers.items():
                if buffer is None or not buffer.is_floating_point() or buffer.dtype == buffer_dtype:
                    continue
                orig_dtypes[f"{prefix}{attr}"] = buffer.dtype
                buffer.data = buffer.data.to(buffer_dtype)
    logger.debug("composable_shard: cast %d buffers of %s to %s", len(orig_dtypes), type(unit).__name__, buffer_dtype)
    return orig_dtypes
