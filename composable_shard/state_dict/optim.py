"""Owns: optimizer state dicts of a sharded tree —
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` in the format of
``torch.distributed.checkpoint.state_dict`` (``"state"`` keyed by parameter
name, ``"param_groups"`` listing names under ``"params"``), full or sharded.

Knows nothing of: files, the training step's hooks, how a model's names are
found (``entries.model_entries``).

A per-parameter state tensor shaped like the (1-D, local) parameter is
sharded exactly like the parameter: in a sharded state dict it is a
RangeShardedTensor of the parameter's original shape (see [Note: sharded state
dict representation]), in a full one a plain tensor of that shape. Anything
else (``step``, other scalars) is kept as it is. A parameter goes by its
canonical name (the one ``named_parameters()`` yields; tied aliases share
one entry). Loading works into a fresh optimizer that has no state yet, and
after a change of world size or strategy: each rank takes its range.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, TypeGuard

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from ..handle import full_views
from .. import comm
from ..handle import FlatParamHandle
from ..handle.dtensor_views import as_grad_of, local_tensor
from ..runtime.state import UnitState
from .owned import gather_owned_state, owned_by
from .checks import StateDictError, checked_options, is_rank0, key_mismatch_message, value_mismatch_message
from .entries import ModelEntries, ShardedParamEntry, full_tensor_of_local, model_entries, prepare_units, sharding_of
from .shards import (
    global_shape,
    is_sharded_tensor,
    local_part,
    param_view,
    range_source_error,
    read_range,
    sharded_tensor_of_range,
)

__all__ = [
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "check_optimizer_state_dict",
    "OptimParam",
    "optimizer_params",
    "init_optimizer_state",
    "is_param_shaped",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class OptimParam:
    """One parameter of the optimizer and the name it goes by."""

    param: nn.Parameter
    fqn: str
    # The unit-owned parameter's entry; None for a parameter no unit owns.
    entry: ShardedParamEntry | None


class _TensorSpec(NamedTuple):
    """Placeholder for a tensor rank 0 broadcasts after the skeleton."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def optimizer_params(optimizer: torch.optim.Optimizer, entries: ModelEntries, what: str) -> list[OptimParam]:
    """The optimizer's parameters in param-group order (torch's numbering)."""
    by_id: dict[int, tuple[str, ShardedParamEntry | None]] = {}
    for key, param in entries.plain_params.items():
        by_id.setdefault(id(param), (key, None))
    for sharded in entries.sharded:
        by_id[id(sharded.param)] = (sharded.keys[0], sharded)
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError(
                    f"{what}: the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter "
                    "of this module. Pass the module the optimizer was built for."
                )
            fqn, entry = by_id[id(param)]
            params.append(OptimParam(param, fqn, entry))
    return params


def is_param_shaped(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether a state value of a parameter of (full) ``shape`` is a
    per-element state to shard. 0-dim parameters: anything but ``step``."""
    if is_sharded_tensor(value):
        return True
    if not isinstance(value, torch.Tensor):
        return False
    return value.dim() > 0 or (len(shape) == 0 and key != "step")


def _is_local_shaped(value: Any, param: nn.Parameter) -> TypeGuard[torch.Tensor]:
    # Local parameters are 1-D, so ``step`` (0-dim) never matches.
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has none yet (as
    ``torch.distributed.checkpoint.state_dict`` does): one step with zero
    gradients and a learning rate of 0, so the parameters do not change.
    Skipped when there is state or any gradient."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    saved_lrs = []
    for group in optimizer.param_groups:
        if "lr" in group:
            saved_lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = saved_lrs.pop(0)
        optimizer.zero_grad(set_to_none=True)


def _param_groups(optimizer: torch.optim.Optimizer, params: list[OptimParam]) -> list[dict[str, Any]]:
    fqns = iter([op.fqn for op in params])
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [next(fqns) for _ in group["params"]]}
        for group in optimizer.param_groups
    ]


# -------------------------------------------------------------------- get
def get_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The optimizer state dict of ``optimizer`` over ``module``'s
    parameters (see the module docstring). An optimizer without state gets
    its state created first (``init_optimizer_state``), so the result can be
    a destination for ``torch.distributed.checkpoint.load``.

    ``full_state_dict=True`` is a collective (one object all-gather, then one
    all-gather per flat parameter and state name); with ``cpu_offload`` only
    rank 0 keeps the result. ``full_state_dict=False`` runs no collective.
    """
    name = type(module).__name__
    what = f"get_optimizer_state_dict({name})"
    options = checked_options(options, "get_optimizer_state_dict", name)
    units = prepare_units(module, "get_optimizer_state_dict")
    params = optimizer_params(optimizer, model_entries(module, units), what)
    init_optimizer_state(optimizer)
    if options.full_state_dict:
        state = _full_state(units, params, optimizer, options)
        if options.cpu_offload and not is_rank0():
            return {}
    else:
        state = _sharded_state(params, optimizer, options)
    return {"state": state, "param_groups": _param_groups(optimizer, params)}


def _plain_value(value: Any, options: StateDictOptions, *, copy: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if options.cpu_offload:
        return value.to("cpu", copy=copy)
    return value.clone() if copy else value


def _sharded_state(
    params: list[OptimParam], optimizer: torch.optim.Optimizer, options: StateDictOptions
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    owned = owned_by(optimizer)
    for op in params:
        param_state = optimizer.state.get(op.param)
        if not param_state or owned.get(id(op.param)) is False:
            continue
        if id(op.param) in owned:  # whole tensors on the owner ([Note: owned optimizer state])
            state[op.fqn] = {k: _plain_value(v, options, copy=False) for k, v in param_state.items()}
            continue
        values = {}
        for key, value in param_state.items():
            if op.entry is not None and _is_local_shaped(value, op.param):
                value = local_tensor(value)  # a DTensor parameter's state: its range
                local = value.detach().cpu() if options.cpu_offload else value.detach()
                values[key] = sharded_tensor_of_range(local, sharding_of(op.entry))
            else:
                values[key] = _plain_value(value, options, copy=False)
        state[op.fqn] = values
    return state


def _full_state(
    units: list[UnitState], params: list[OptimParam], optimizer: torch.optim.Optimizer, options: StateDictOptions
) -> dict[str, Any]:
    """Gather every per-element state, one (flat parameter, state name) at a
    time, packed like the flat parameter so one all-gather serves it all."""
    keep = not options.cpu_offload or is_rank0()
    owned = owned_by(optimizer)
    if owned:  # [Note: owned optimizer state]
        mine = {op.fqn: optimizer.state[op.param] for op in params if owned.get(id(op.param)) and optimizer.state.get(op.param)}
        device = None if options.cpu_offload else _device_of(params)
        gathered = gather_owned_state(mine, device=device)
        params = [op for op in params if id(op.param) not in owned]
    merged = _merged_state_layout(params, optimizer)
    state: dict[str, dict[str, Any]] = {}
    if owned:
        state.update(gathered)
    for op in params:  # the order of the result: optimizer order, state order
        if op.entry is None and optimizer.state.get(op.param):
            state[op.fqn] = {k: _plain_value(v, options, copy=True) for k, v in optimizer.state[op.param].items()}
        elif op.fqn in merged:
            state[op.fqn] = {
                key: _plain_value(item[1], options, copy=True) if item[0] == "value" else None
                for key, item in merged[op.fqn].items()
            }
    by_handle: dict[int, list[OptimParam]] = {}
    for op in params:
        if op.entry is not None and op.fqn in merged:
            by_handle.setdefault(id(op.entry.handle), []).append(op)
    for unit in units:
        for handle in unit.handles:
            ops = by_handle.get(id(handle), [])
            names = {(key, item[1]) for op in ops for key, item in merged[op.fqn].items() if item[0] == "sharded"}
            for key, dtype in sorted(names, key=lambda name: (name[0], str(name[1]))):
                full_flat = _gather_state(handle, ops, optimizer, key, dtype)  # collective
                if not keep:
                    continue
                for op in ops:
                    if merged[op.fqn].get(key, ("",))[0] == "sharded":
                        info = op.entry.info  # type: ignore[union-attr]  # ops are sharded
                        view = param_view(full_flat, info)
                        if op.entry.local_box is not None:  # type: ignore[union-attr]  # collective over tp
                            view = full_tensor_of_local(op.entry, view)  # type: ignore[arg-type]
                        state[op.fqn][key] = view.to("cpu", copy=True) if options.cpu_offload else view.clone()
    return state if keep else {}


def _device_of(params: list[OptimParam]) -> torch.device:
    return params[0].param.device if params else torch.device("cpu")


def _merged_state_layout(params: list[OptimParam], optimizer: torch.optim.Optimizer) -> dict[str, dict[str, tuple]]:
    """Per sharded parameter, every state name any rank holds: ("sharded",
    dtype) or ("value", value). Ranks whose range is empty may have no state
    (no gradient ever reached it), so every rank learns the union."""
    local: dict[str, dict[str, tuple]] = {}
    for op in params:
        param_state = optimizer.state.get(op.param)
        if op.entry is None or not param_state:
            continue
        local[op.fqn] = {
            key: ("sharded", value.dtype) if _is_local_shaped(value, op.param) else ("value", _cpu_copy(value))
            for key, value in param_state.items()
        }
    # The sharded parameters each rank's optimizer steps: gathered with the
    # names, since a parameter one rank's optimizer leaves out would gather
    # zeros for that rank's range, silently (FSDP1 raises too).
    stepped = sorted(op.fqn for op in params if op.entry is not None)
    merged: dict[str, dict[str, tuple]] = {}
    gathered = comm.all_gather_object((local, stepped))
    differing = sorted(set().union(*(fqns for _, fqns in gathered)) - set.intersection(*(set(f) for _, f in gathered)))
    if differing:
        raise StateDictError(
            f"get_optimizer_state_dict: the optimizers of some ranks do not step {differing[:4]}, which others do: "
            "their parts of its state would be missing. Build the optimizer over the same parameters on every rank."
        )
    for rank_state, _ in gathered:
        for fqn, names in rank_state.items():
            for key, item in names.items():
                merged.setdefault(fqn, {}).setdefault(key, item)
    return merged


def _cpu_copy(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _gather_state(
    handle: FlatParamHandle, ops: list[OptimParam], optimizer: torch.optim.Optimizer, key: str, dtype: torch.dtype
) -> torch.Tensor:
    layout = handle.layout
    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=handle.compute_device)
    for op in ops:
        value = (optimizer.state.get(op.param) or {}).get(key)
        info = op.entry.info  # type: ignore[union-attr]  # ops are sharded
        if info.local_numel and _is_local_shaped(value, op.param):
            shard[info.shard_offset : info.shard_offset + info.local_numel].copy_(local_tensor(value).detach().reshape(-1))
    return full_views.gather_full(handle, shard)


# -------------------------------------------------------------------- set
def set_optimizer_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load a full or sharded optimizer state dict (the format of
    ``get_optimizer_state_dict``) into ``optimizer``: each rank takes its
    range of every per-element state; hyperparameters come from the saved
    param groups. Works on a fresh optimizer. Validates everything before
    changing anything (``StateDictError``). With ``broadcast_from_rank0``
    only rank 0's ``state_dict`` is read (a collective)."""
    name = type(module).__name__
    what = f"set_optimizer_state_dict({name})"
    options = checked_options(options, "set_optimizer_state_dict", name)
    units = prepare_units(module, "set_optimizer_state_dict")
    params = optimizer_params(optimizer, model_entries(module, units), what)
    owned = owned_by(optimizer)
    if options.broadcast_from_rank0:
        state, groups = _receive_broadcast(params, state_dict, options, what, owned)
    else:
        _check(params, state_dict, options, what, owned)
        state = {
            fqn: {
                key: _local_value(op, key, value, owned, optimizer.state.get(op.param, {}).get(key))
                for key, value in state_dict["state"][fqn].items()
            }
            for fqn, op in _by_fqn(params).items()
            if fqn in state_dict["state"]
        }
        groups = list(state_dict["param_groups"])
    # A parameter's state stays on its owner only ([Note: owned optimizer state]).
    state = {fqn: values for fqn, values in state.items() if owned.get(id(_by_fqn(params)[fqn].param)) is not False}
    _load(optimizer, params, state, groups)


def check_optimizer_state_dict(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Raise ``StateDictError`` where ``set_optimizer_state_dict`` would,
    changing nothing (to validate a whole checkpoint before loading any of
    it). Not for ``broadcast_from_rank0``."""
    name = type(module).__name__
    what = f"set_optimizer_state_dict({name})"
    options = checked_options(options, "set_optimizer_state_dict", name)
    params = optimizer_params(optimizer, model_entries(module, prepare_units(module, "set_optimizer_state_dict")), what)
    _check(params, state_dict, options, what, owned_by(optimizer))


def _by_fqn(params: list[OptimParam]) -> dict[str, OptimParam]:
    return {op.fqn: op for op in params}


def _check(
    params: list[OptimParam], state_dict: Mapping[str, Any], options: StateDictOptions, what: str, owned: dict[int, bool]
) -> None:
    """Raise ``StateDictError`` unless ``state_dict`` fits the optimizer."""
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), (list, tuple))
        or not all(isinstance(g, Mapping) and "params" in g for g in state_dict["param_groups"])
    ):
        raise StateDictError(
            f"{what}: expected a dict with 'state' (name -> state) and 'param_groups' (dicts listing names under "
            "'params'), as get_optimizer_state_dict returns. Pass such a dict."
        )
    by_fqn = _by_fqn(params)
    listed = [fqn for group in state_dict["param_groups"] for fqn in group["params"]]
    unexpected = [fqn for fqn in state_dict["state"] if fqn not in by_fqn]
    unexpected += [fqn for fqn in listed if fqn not in by_fqn and fqn not in unexpected]
    missing = [fqn for fqn in by_fqn if fqn not in set(listed)]
    if options.strict and (unexpected or missing):
        raise StateDictError(key_mismatch_message(what, missing, unexpected))
    problems = []
    for fqn, values in state_dict["state"].items():
        op = by_fqn.get(fqn)
        if op is None:
            continue  # strict=False: parameters this optimizer does not hold are skipped
        if id(op.param) in owned:
            problems += _owned_problems(fqn, op, values)
            continue
        box = op.entry.local_box if op.entry is not None else None
        shape = op.entry.info.shape if op.entry is not None else op.param.shape
        if box is not None:
            shape = box.global_shape
        for key, value in (values or {}).items():
            if op.entry is not None and is_param_shaped(key, value, shape):
                why = range_source_error(value, op.entry.info.shape, op.entry.info.local_start, op.entry.info.local_numel, box)
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and global_shape(value) != shape:
                why = f"shape {tuple(value.shape)} does not match the parameter's {tuple(shape)}"
            else:
                why = None
            if why is not None:
                problems.append((f"{fqn}.{key}", why))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))


def _owned_problems(fqn: str, op: OptimParam, values: Any) -> list[tuple[str, str]]:
    """An owner-stepped parameter's state holds whole tensors: any shape its
    update rule made, but one with the parameter's numel must have its shape."""
    shape = op.entry.info.shape if op.entry is not None else op.param.shape
    problems = []
    for key, value in (values or {}).items():
        if is_sharded_tensor(value):
            problems.append((f"{fqn}.{key}", "a sharded range where the owner needs the whole tensor"))
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == shape.numel() and value.shape != shape:
            problems.append((f"{fqn}.{key}", f"shape {tuple(value.shape)} does not match the parameter's {tuple(shape)}"))
    return problems


def _local_value(op: OptimParam, key: str, value: Any, owned: dict[int, bool], current: Any) -> Any:
    """This rank's part of a checked state value (a new tensor, or the
    state dict's own whole buffer, never a view into a larger tensor, unless
    it is the memory of ``current``, the live state it was read into); an
    owner-stepped parameter's whole value."""
    if op.entry is None or id(op.param) in owned or not is_param_shaped(key, value, op.entry.info.shape):
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    info = op.entry.info
    local = read_range(value, info.local_start, info.local_numel, op.entry.local_box)
    if is_sharded_tensor(value) and _same_memory(local, current):
        # Read in place into the live tensor (a view of a run's state under
        # the flat step: [Note: the flat step] in optim/flat_step.py): keep it.
        return current
    nbytes = local.numel() * local.element_size()
    spans_storage = local.storage_offset() == 0 and local.untyped_storage().nbytes() == nbytes
    return local if spans_storage and is_sharded_tensor(value) else local.clone()


def _same_memory(local: torch.Tensor, current: Any) -> bool:
    return (
        type(current) is torch.Tensor
        and local.numel() > 0
        and local.shape == current.shape
        and local.dtype == current.dtype
        and local.is_contiguous()
        and current.is_contiguous()
        and local.data_ptr() == current.data_ptr()
    )


def _load(
    optimizer: torch.optim.Optimizer, params: list[OptimParam], state: dict[str, Any], groups: list[Mapping[str, Any]]
) -> None:
    saved_group_of = {fqn: group for group in groups for fqn in group["params"]}
    index_of = {id(op.param): index for index, op in enumerate(params)}
    by_id = {id(op.param): op for op in params}
    torch_groups = []
    for group in optimizer.param_groups:
        fqns = [by_id[id(p)].fqn for p in group["params"]]
        saved = next((saved_group_of[fqn] for fqn in fqns if fqn in saved_group_of), group)
        hyper = {k: v for k, v in saved.items() if k != "params"}
        torch_groups.append({**hyper, "params": [index_of[id(p)] for p in group["params"]]})
    torch_state = {index: state[op.fqn] for index, op in enumerate(params) if op.fqn in state}
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})
    for op in params:
        if op.entry is not None and op.entry.local_box is not None:
            _as_dtensor_state(op.param, optimizer.state.get(op.param, {}))
    logger.debug("set_optimizer_state_dict: loaded state of %d parameters", len(torch_state))


def _as_dtensor_state(param: nn.Parameter, state: dict[str, Any]) -> None:
    """A DTensor parameter's per-element states as DTensors of its spec
    (optimizers' DTensor rules need every operand a DTensor): loaded values
    are this rank's range as plain tensors."""
    held = local_tensor(param)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
            if value.shape == held.shape:
                state[key] = as_grad_of(param, value)


def _receive_broadcast(
    params: list[OptimParam], state_dict: Mapping[str, Any], options: StateDictOptions, what: str,
    owned: dict[int, bool],
) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    """Rank 0 checks its state dict and broadcasts a skeleton (scalars by
    value, per-element tensors as specs), then each such tensor; every rank
    keeps its range of each."""
    skeleton: dict[str, Any] = {}
    if is_rank0():
        try:
            _check(params, state_dict, options, what, owned)
            by_fqn = _by_fqn(params)
            skeleton = {"error": None, "param_groups": list(state_dict["param_groups"]), "state": {}}
            for fqn, values in state_dict["state"].items():
                sender = by_fqn[fqn]
                skeleton["state"][fqn] = {
                    key: _TensorSpec(tuple(global_shape(value)), value.dtype)  # type: ignore[arg-type]
                    if sender.entry is not None and isinstance(value, torch.Tensor)
                    and (id(sender.param) in owned or is_param_shaped(key, value, sender.entry.info.shape))
                    else value
                    for key, value in (values or {}).items()
                }
        except StateDictError as exc:
            skeleton = {"error": str(exc)}
    skeleton = comm.broadcast_object(skeleton)
    if skeleton["error"] is not None:
        raise StateDictError(skeleton["error"])
    # In rank 0's order, the same on every rank whatever order each
    # optimizer holds its parameters in (each broadcast pairs up by it).
    by_fqn = _by_fqn(params)
    # Where a tensor this rank does not keep is received: any of its sharded parameters' device.
    fallback_device = next((op.entry.handle.compute_device for op in params if op.entry is not None), torch.device("cpu"))
    state: dict[str, Any] = {}
    absent: list[str] = []
    for fqn, values in skeleton["state"].items():
        op = by_fqn.get(fqn)
        if op is None:
            absent.append(fqn)
        else:
            state[fqn] = {}
        for key, item in values.items():
            if not isinstance(item, _TensorSpec):
                if op is not None:  # rank 0's own objects: copied, as every other load path does
                    state[fqn][key] = item.clone() if isinstance(item, torch.Tensor) else copy.deepcopy(item)
                continue
            device = op.entry.handle.compute_device if op is not None and op.entry is not None else fallback_device
            full = _broadcast_full(state_dict, fqn, key, item, device)
            if op is None:
                continue  # received only to keep the broadcasts paired
            if id(op.param) in owned:  # the owner keeps it whole
                state[fqn][key] = full.view(item.shape).clone()
                continue
            info = op.entry.info  # type: ignore[union-attr]  # specs are for sharded parameters
            box = op.entry.local_box  # type: ignore[union-attr]
            if box is not None:
                full = box.of_full(full.view(box.global_shape))
            state[fqn][key] = local_part(full, info).clone()
    if absent:
        raise StateDictError(
            f"{what}: rank 0's optimizer state holds {sorted(absent)[:4]}, which this rank's optimizer does not "
            "step. Build the optimizer over the same parameters on every rank. Nothing was loaded on this rank."
        )
    return state, skeleton["param_groups"]


def _broadcast_full(
    state_dict: Mapping[str, Any], fqn: str, key: str, spec: _TensorSpec, device: torch.device
) -> torch.Tensor:
    numel = torch.Size(spec.shape).numel()
    if is_rank0():
        tensor = state_dict["state"][fqn][key].detach().reshape(-1).to(device).contiguous()
    else:
        tensor = torch.empty(numel, dtype=spec.dtype, device=device)
    comm.broadcast(tensor, 0, None)
    return tensor
