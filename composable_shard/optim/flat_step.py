"""Owns: the flat step — torch's elementwise optimizers step each run of a
unit's parameters that lie back to back in its shard as one tensor, around
the optimizer's own ``step``; the parameters' optimizer state stays theirs.

Knows nothing of: the optimizers' update rules, hooks, collectives.

Public names: ``set_flat_step``, ``before_step``, ``after_step``, ``settle``.

[Note: the flat step]
Between steps every parameter of a unit is a 1-D view of the unit's shard,
and its ``.grad`` a view of the sharded gradient at the same offset. An
elementwise optimizer ([Note: optimizers over shards] in
runtime/optimizer_checks.py) computes the same element from the same
element wherever it lies, so stepping the parameters ``p1 .. pk`` of one
parameter group one after the other is stepping the one tensor they tile
when they lie back to back. torch's single-tensor optimizers (the default
on CPU) pay per tensor, a dozen Python-level operations each: on the
bench's many-small GPT (65 units, 772 parameters, a fake group of 2)
AdamW's step with the usual two groups took 30 ms over the views and 16
ms flat.

``before_step`` finds, in each parameter group, the runs of at least two
parameters of one flat parameter (on the CPU) that are consecutive in its
layout with nothing between them in the shard, whatever their order in the
group (parameters of which this rank holds nothing ride along); a run is
stepped flat when each parameter still shows its range of the shard and a
``.grad`` in its dtype, the non-empty ones views of one flat gradient at
the same offsets (a gradient the user replaced or cleared makes its run
step per parameter: a cleared one is skipped, as torch skips it). One
tensor per run takes the place of the run's first parameter in the group's
``params`` (the others leave it), with the run's range of the gradient as
its ``.grad`` and the run's state as its state. AdamW's usual groups split
the parameters by weight decay (matrices decayed, biases and norms not),
which interleaves them in every layout; groups that differ in
``weight_decay`` alone (a float ``lr``, not fused) are one class, whose runs
span them: they are stepped in a group added for the step with the
class's hyperparameters and no weight decay, each decayed parameter
having been multiplied by ``1 - lr * weight_decay`` of its own group first
(AdamW's decoupled decay, the operation it does before the update, so the
bits are the same). The optimizer's own ``step`` runs unchanged.
``after_step`` puts the groups' own lists back (and drops the added group)
and gives each parameter its state: every tensor of the run's state the
size of the run as the parameter's range of it (a view: a write to either
reaches both), every 0-dim tensor (the step count)
as the first parameter's own and a copy of it for each other parameter,
brought up to date after every step (never one object for several
parameters: a parameter stepped alone later, or a state dict loaded into
an optimizer that steps per parameter, counts its own steps). So
``optimizer.state[p]`` holds what per-parameter stepping would hold, in
the same format (``state_dict``, checkpoints and their sizes unchanged;
only the order of ``optimizer.state``'s entries may differ). A run's state
is the run's own while every parameter holds what ``after_step`` gave it
with equal step counts; else it is made from the parameters' states: their
tensors' one tensor where they are views of it at the run's offsets (state
loaded in place), else a concatenation (separate tensors, after
``load_state_dict``), when every parameter has state of the same form and
equal scalars; none when none has any (the optimizer makes it at its first
step); else the run is stepped per parameter.

Where it applies: the eleven ``torch.optim`` classes of
``ELEMENTWISE_OPTIMIZERS`` by exact type (not classes declared with
``register_elementwise_optimizer``, whose state may have any form), not
``differentiable``, stepped without a closure (the closure makes the
gradients after this hook), on an optimizer without step hooks of its own
(they would see the runs), outside ``torch.compile``, over plain
parameters (a tensor-parallel one shows a ``DTensor``) of units that
compute on the CPU (on CUDA torch's default foreach path already steps all
tensors in a few kernels; CPU-offloaded shards of CUDA units are left
alone too: this path has not run beside a GPU). Everything else steps as
before; ``set_flat_step(optimizer, False)`` or
``COMPOSABLE_SHARD_FLAT_STEP=0`` switches it off. The results are bitwise
those of per-parameter stepping (every update is elementwise; pinned for
all eleven); the single-tensor path's temporaries are a run's instead of a
parameter's, which the plan counts ([Note: Adam's single-tensor step,
planned] in planning/memory.py, with ``flat_runs`` of optim/flat_runs.py).
A step that raised leaves the runs in the groups: ``settle`` (the
lifecycle's gate, at the next forward, state-dict call or step) puts the
groups back and gives the parameters the runs' state first. Pinned by
tests/optim/test_flat_step.py.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..handle import FlatParamHandle
from ..runtime.lifecycle import live_units
from ..runtime.optimizer_checks import ELEMENTWISE_OPTIMIZERS
from .flat_runs import FLAT_STEP_ENV, flat_runs, flat_step_enabled

__all__ = ["before_step", "after_step", "settle", "set_flat_step"]

_STEPPABLE = frozenset(ELEMENTWISE_OPTIMIZERS)


@dataclass
class _Run:
    """Parameters of one class of groups that lie back to back in one
    shard, in layout order: stepped as one tensor when their gradients do
    too."""

    # Weak, as every reference here: an optimizer does not keep a model alive.
    handle: weakref.ReferenceType[FlatParamHandle]
    params: list[torch.nn.Parameter]
    # Each parameter's first element within the run, and element count.
    starts: list[int]
    numels: list[int]
    # The run's first element in the shard, and its element count.
    offset: int
    numel: int
    # The index in ``optimizer.param_groups`` of each parameter's group.
    groups: list[int] = field(default_factory=list)
    # The state the optimizer stepped last (None: none yet), the state dict
    # after_step gave each parameter and the values it put in them.
    state: dict[str, Any] | None = None
    state_values: tuple = ()
    made: list[dict[str, Any]] = field(default_factory=list)
    made_values: list[tuple] = field(default_factory=list)
    # Each 0-dim value of the run's state (the first parameter's own) with
    # the other parameters' copies of it, brought up to date after a step.
    scalars: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    # The tensor this step steps.
    flat: torch.Tensor | None = None


@dataclass
class _Swap:
    """What one step changed in the optimizer's groups, to put back."""

    # Each group whose list of parameters was replaced, with its own list.
    replaced: list[tuple[dict[str, Any], list[torch.nn.Parameter]]] = field(default_factory=list)
    # Groups added for runs over several groups ([Note: the flat step]).
    added: list[dict[str, Any]] = field(default_factory=list)
    runs: list[_Run] = field(default_factory=list)


# Per optimizer: the runs of each class of groups, keyed by the groups'
# indices and their parameters' ids.
_RUNS: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[tuple, list[_Run]]] = weakref.WeakKeyDictionary()
_IN_FLIGHT: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap] = weakref.WeakKeyDictionary()
# id(parameter) -> (handle, index), for the live units with the given key.
_PLACES: dict[str, Any] = {"key": None, "where": {}}


# Optimizers set_flat_step(optimizer, False) switched to per-parameter stepping.
_PER_PARAMETER: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def set_flat_step(optimizer: torch.optim.Optimizer, enabled: bool = True) -> None:
    """Whether ``optimizer`` may step the runs of parameters that lie back
    to back in a unit's shard as one tensor ([Note: the flat step]; on by
    default for torch.optim's elementwise optimizers over CPU shards). The
    results are the same either way; off, each parameter is stepped alone
    (the environment variable ``COMPOSABLE_SHARD_FLAT_STEP=0`` switches it
    off for every optimizer)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"set_flat_step: expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if enabled:
        _PER_PARAMETER.discard(optimizer)
    else:
        _PER_PARAMETER.add(optimizer)


def _enabled(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    return (
        type(optimizer) in _STEPPABLE
        and optimizer not in _PER_PARAMETER
        and len(args) <= 1  # the optimizer itself; a closure would follow it
        and kwargs.get("closure") is None
        and not optimizer.defaults.get("differentiable", False)
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and flat_step_enabled()
        and not torch.compiler.is_compiling()
    )


def _places() -> dict[int, tuple[weakref.ReferenceType[FlatParamHandle], int]]:
    units = live_units()
    key = tuple((unit.build_index, id(unit)) for unit in units)
    if _PLACES["key"] != key:
        where = {}
        for unit in units:
            for handle in unit.handles:
                for index, (param, spec) in enumerate(zip(handle.orig_params, handle.tp_specs)):
                    if spec is None:
                        where[id(param)] = (weakref.ref(handle), index)
        _PLACES.update(key=key, where=where)
    return _PLACES["where"]


def before_step(optimizer: torch.optim.Optimizer, units: list, args: tuple, kwargs: dict) -> None:
    """Replace the runs of each class of groups by one tensor each ([Note:
    the flat step])."""
    if not _enabled(optimizer, args, kwargs):
        return
    where = _places()
    if not where:
        return
    groups = optimizer.param_groups
    cache = _RUNS.setdefault(optimizer, {})
    used: dict[tuple, list[_Run]] = {}
    swap = _Swap()
    try:
        for members in _classes(optimizer):
            key = (tuple(members), tuple(tuple(map(id, groups[g]["params"])) for g in members))
            runs = cache.get(key)
            if runs is None:
                runs = _find_runs([(g, groups[g]["params"]) for g in members], where)
            used[key] = runs
            ready = [run for run in runs if _ready(run) and _take_state(optimizer, run)]
            if ready:
                _put_runs_in_groups(optimizer, members, ready, swap)
        cache.clear()
        cache.update(used)
    except BaseException:
        _restore(optimizer, swap, stepped=False)
        raise
    if swap.runs:
        _IN_FLIGHT[optimizer] = swap


def _classes(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """The parameter groups stepped together: AdamW's groups that differ in
    ``weight_decay`` alone (a float ``lr``, not fused) form one class, whose
    runs may span parameters of several of them; any other group is a
    class of its own."""
    groups = optimizer.param_groups
    if type(optimizer) is not torch.optim.AdamW:
        return [[index] for index in range(len(groups))]
    classes: dict[object, list[int]] = {}
    for index, group in enumerate(groups):
        key: object = ("alone", index)
        decay = group["weight_decay"]
        if isinstance(group["lr"], float) and not group.get("fused") and type(decay) in (int, float):
            hyper = tuple(sorted((k, v) for k, v in group.items() if k not in ("params", "weight_decay")))
            try:
                hash(hyper)
                key = hyper
            except TypeError:  # a value that does not hash (a tensor): alone
                pass
        classes.setdefault(key, []).append(index)
    return list(classes.values())


def _put_runs_in_groups(optimizer: torch.optim.Optimizer, members: list[int], runs: list[_Run], swap: _Swap) -> None:
    """Step each of ``runs`` as one tensor: in its group, at its first
    parameter's place, for a class of one group; else in a group added for
    the step, with the class's hyperparameters and the weight decay of each
    parameter's own group applied first (AdamW's ``param.mul_(1 - lr *
    weight_decay)``, before its update, as AdamW does), none by the step."""
    groups = optimizer.param_groups
    in_runs = {id(param) for run in runs for param in run.params}
    if len(members) == 1:
        group = groups[members[0]]
        params = group["params"]
        place = {id(param): index for index, param in enumerate(params)}
        firsts = {id(min(run.params, key=lambda param: place[id(param)])): run for run in runs}
        stepped: list[torch.Tensor] = []
        for param in params:
            run = firsts.get(id(param))
            if run is not None:
                stepped.append(run.flat)  # type: ignore[arg-type]  # _ready set it
            elif id(param) not in in_runs:
                stepped.append(param)
        swap.replaced.append((group, params))
        group["params"] = stepped
    else:
        decays = {g: groups[g]["weight_decay"] for g in members}
        for g in members:
            swap.replaced.append((groups[g], groups[g]["params"]))
            groups[g]["params"] = [param for param in groups[g]["params"] if id(param) not in in_runs]
        added = {k: v for k, v in groups[members[0]].items() if k != "params"}
        if len(set(decays.values())) > 1:
            added["weight_decay"] = 0.0
            # One call per factor (each parameter's own ``mul_``, the same bits).
            decayed: dict[float, list[torch.Tensor]] = {}
            for run in runs:
                for param, g in zip(run.params, run.groups):
                    if decays[g] != 0:
                        decayed.setdefault(1 - groups[g]["lr"] * decays[g], []).append(param)
            with torch.no_grad():
                for factor, params in decayed.items():
                    torch._foreach_mul_(params, factor)
        added["params"] = [run.flat for run in runs]
        groups.append(added)
        swap.added.append(added)
    for run in runs:
        if run.state is not None:
            optimizer.state[run.flat] = run.state  # type: ignore[index]  # _ready set it
    swap.runs += runs


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """Put the groups' own parameters back, each with its state."""
    swap = _IN_FLIGHT.pop(optimizer, None)
    if swap is not None:
        _restore(optimizer, swap, stepped=True)


def settle() -> None:
    """A step that raised: put the groups back (the state the runs have, as
    after a step: elementwise, what was stepped is the parameters')."""
    while _IN_FLIGHT:
        optimizer, swap = _IN_FLIGHT.popitem()
        _restore(optimizer, swap, stepped=True)


def _find_runs(
    classes: list[tuple[int, list]], where: dict[int, tuple[weakref.ReferenceType[FlatParamHandle], int]]
) -> list[_Run]:
    """The runs of the parameters of a class of groups, by their layouts
    (gradients are checked at each step by ``_ready``): parameters of one
    flat parameter on the CPU, consecutive in its layout with nothing
    between them in the shard, in the class's groups whatever their order
    there."""
    # id(handle) -> the handle, and layout index -> (parameter, its group).
    by_handle: dict[int, tuple[FlatParamHandle, dict[int, tuple[torch.nn.Parameter, int]]]] = {}
    for g, params in classes:
        for param in params:
            place = where.get(id(param))
            owner = place[0]() if place is not None else None
            # CPU training only: an offloaded shard's gradient comes from a device.
            if owner is not None and owner.requires_grad and owner.compute_device.type == "cpu":
                by_handle.setdefault(id(owner), (owner, {}))[1][place[1]] = (param, g)  # type: ignore[index]
    runs: list[_Run] = []
    for handle, present in by_handle.values():
        # The layout's runs (flat_runs: the plan's rule too), cut where a
        # parameter of the run is not in the class.
        for layout_run in flat_runs(handle.layout.params):
            members: list[tuple[int, torch.nn.Parameter, int]] = []
            for index in [*layout_run, None]:
                if index is not None and index in present:
                    members.append((index, *present[index]))
                    continue
                if len(members) > 1 and any(handle.layout.params[i].local_numel for i, _, _ in members):
                    runs.append(_make_run(handle, members))
                members = []
    return runs


def _make_run(handle: FlatParamHandle, members: list[tuple[int, torch.nn.Parameter, int]]) -> _Run:
    infos = [handle.layout.params[index] for index, _, _ in members]
    filled = [info for info in infos if info.local_numel]
    offset = filled[0].shard_offset
    numel = filled[-1].shard_offset + filled[-1].local_numel - offset
    starts, numels, position = [], [], 0
    for info in infos:
        if info.local_numel:
            position = info.shard_offset - offset
        starts.append(position)
        numels.append(info.local_numel)
        position += info.local_numel
    params = [param for _, param, _ in members]
    groups = [g for _, _, g in members]
    return _Run(weakref.ref(handle), params, starts, numels, offset, numel, groups)


def _ready(run: _Run) -> bool:
    """Whether every parameter of ``run`` shows its range of the shard and
    a ``.grad`` in its dtype, the non-empty ones contiguous views of one
    flat gradient at the same offsets (as the runtime sets them, unless
    the user replaced one); then ``run.flat`` is the tensor to step."""
    handle = run.handle()
    if handle is None:
        return False
    shard = handle.sharded_flat_param
    size = shard.element_size()
    base_ptr = shard.data_ptr() + run.offset * size
    first_grad: torch.Tensor | None = None
    first_start = grad_ptr = 0
    for param, start, numel in zip(run.params, run.starts, run.numels):
        grad = param.grad
        if grad is None or type(grad) is not torch.Tensor or grad.dtype != param.dtype:
            return False
        if not numel:
            continue
        if param.data_ptr() != base_ptr + start * size or not grad.is_contiguous():
            return False
        if first_grad is None:
            first_grad, first_start, grad_ptr = grad, start, grad.data_ptr() - start * size
            if first_grad._base is None:
                return False
        elif grad._base is not first_grad._base or grad.data_ptr() != grad_ptr + start * size:
            return False
    assert first_grad is not None  # a run has a non-empty member
    flat = shard.detach().narrow(0, run.offset, run.numel)
    flat.grad = first_grad.detach().as_strided((run.numel,), (1,), first_grad.storage_offset() - first_start)
    run.flat = flat
    return True


def _still_given(optimizer: torch.optim.Optimizer, run: _Run) -> bool:
    """Whether every parameter of ``run`` holds the state dict and values
    ``after_step`` gave it (its 0-dim values are compared apart)."""
    if not run.made:
        return False
    state = optimizer.state
    for param, mine, values in zip(run.params, run.made, run.made_values):
        theirs = state.get(param)
        if mine is not theirs or len(theirs) != len(values) or not all(map(operator.is_, theirs.values(), values)):
            return False
    return True


def _scalars_unchanged(run: _Run) -> bool:
    """Whether every copy of a 0-dim state value (a step count) still
    equals the value it was copied from (``item``: a comparison of a few
    hundred 0-dim tensors, once per step, costs less than stacking them)."""
    for value, copies in run.scalars:
        first = value.item()
        for copy in copies:
            if copy.item() != first:
                return False
    return True


def _take_state(optimizer: torch.optim.Optimizer, run: _Run) -> bool:
    """Give ``run`` its state: the run's own while every parameter still
    holds what ``after_step`` gave it, else one made from the parameters'
    (None where none has any); False where the parameters' states have no
    common form (the run is then stepped per parameter)."""
    if _still_given(optimizer, run) and _scalars_unchanged(run):
        return True
    states = [optimizer.state.get(param) for param in run.params]
    run.made, run.made_values, run.state, run.state_values, run.scalars = [], [], None, (), []
    if all(not state for state in states):
        return True
    if not all(states):
        return False
    joined = _join_states(run, states)  # type: ignore[arg-type]  # all present
    if joined is None:
        return False
    run.state = joined
    return True


def _join_states(run: _Run, states: list[dict[str, Any]]) -> dict[str, Any] | None:
    keys = list(states[0])
    if any(list(state) != keys for state in states):
        return None
    joined: dict[str, Any] = {}
    for key in keys:
        values = [state[key] for state in states]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            if not all(isinstance(v, torch.Tensor) and v.dim() == 0 and torch.equal(v, first) for v in values):
                return None
            joined[key] = first  # the first parameter's own: the others' copies follow it
        elif isinstance(first, torch.Tensor):
            if not all(
                type(v) is torch.Tensor and v.shape == param.shape and v.dtype == first.dtype
                for v, param in zip(values, run.params)
            ):
                return None
            joined[key] = _tiled(run, values)
            if joined[key] is None:  # separate tensors (a fresh load): one copy
                flat = torch.zeros(run.numel, dtype=first.dtype, device=first.device)
                for value, start, numel in zip(values, run.starts, run.numels):
                    flat[start : start + numel].copy_(value.reshape(-1))
                joined[key] = flat
        else:
            if any(type(v) is not type(first) or v != first for v in values):
                return None
            joined[key] = first
    return joined


def _tiled(run: _Run, values: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor ``values`` are contiguous views of at the run's
    offsets (state loaded in place into a run's views), else None."""
    filled = [(value, start) for value, start, numel in zip(values, run.starts, run.numels) if numel]
    first, first_start = filled[0]
    base = first._base
    if base is None or first.storage_offset() < first_start:
        return None
    size = first.element_size()
    origin = first.data_ptr() - first_start * size
    for value, start in filled:
        if value._base is not base or not value.is_contiguous() or value.data_ptr() != origin + start * size:
            return None
    offset = first.storage_offset() - first_start
    if (offset + run.numel) * size > first.untyped_storage().nbytes():
        return None
    return base.detach().as_strided((run.numel,), (1,), offset)


def _restore(optimizer: torch.optim.Optimizer, swap: _Swap, *, stepped: bool) -> None:
    groups = optimizer.param_groups
    for added in swap.added:
        for index, group in enumerate(groups):
            if group is added:
                del groups[index]
                break
    for group, params in swap.replaced:
        group["params"] = params
    # The step counts of runs stepped in place, copied in one call.
    copies: list[torch.Tensor] = []
    originals: list[torch.Tensor] = []
    for run in swap.runs:
        state = optimizer.state.pop(run.flat, None) if run.flat is not None else None
        run.flat = None
        if state is None or not stepped:
            continue  # nothing stepped: the parameters' own state is as it was
        values = tuple(state.values())
        if (
            state is run.state
            and run.made
            and len(values) == len(run.state_values)
            and all(map(operator.is_, values, run.state_values))
        ):
            # Stepped in place: the parameters' views show it, and their
            # scalars follow the first's.
            for value, of_value in run.scalars:
                copies += of_value
                originals += [value] * len(of_value)
            continue
        _spread(optimizer, run, state)
    if copies:
        torch._foreach_copy_(copies, originals)


def _spread(optimizer: torch.optim.Optimizer, run: _Run, state: dict[str, Any]) -> None:
    """Give each parameter its range of the run's state ([Note: the flat
    step]): tensors as views, 0-dim tensors as the first parameter's own
    object and copies of it for the others (never shared: a parameter
    stepped alone later, or a state dict loaded into per-parameter
    stepping, counts its own steps)."""
    made: list[dict[str, Any]] = [{} for _ in run.params]
    scalars: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            copies = [value.clone() for _ in run.params[1:]]
            for mine, piece in zip(made, [value, *copies]):
                mine[key] = piece
            scalars.append((value, copies))
            continue
        if isinstance(value, torch.Tensor):
            if value.dim() != 1 or value.numel() != run.numel:
                raise RuntimeError(
                    f"composable_shard: {type(optimizer).__name__}'s state '{key}' has shape {tuple(value.shape)} "
                    f"for a run of {run.numel} elements, so it is not elementwise. Set {FLAT_STEP_ENV}=0 "
                    "and report this."
                )
            for mine, start, numel in zip(made, run.starts, run.numels):
                mine[key] = value.narrow(0, start, numel)
            continue
        for mine in made:
            mine[key] = value
    for param, mine in zip(run.params, made):
        optimizer.state[param] = mine
    run.state = state
    run.state_values = tuple(state.values())
    run.made = made
    run.made_values = [tuple(mine.values()) for mine in made]
    run.scalars = scalars
