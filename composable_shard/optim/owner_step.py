"""Owns: stepping a per-parameter optimizer that is not elementwise over the
parameters of units — each whole parameter by its owner rank — around the
optimizer's own ``step``.

Knows nothing of: the optimizer's update rule, hooks, state dicts.

Public names: ``before_step``, ``after_step``, ``settle``, ``owner_plans``,
``StepTraffic``, ``last_step_traffic``.

[Note: owner computes]
An elementwise optimizer steps each rank's slice. Any other per-parameter
optimizer (Muon, Adafactor, Shampoo/SOAP, a user's own that reads a shape or
a norm) is exact only over whole parameters, so around its step:

1. ``before_step`` (after the lifecycle's gate): one ``all_reduce`` (max) of
   a flag per parameter says which have a gradient on some rank (a single
   process skips a parameter whose ``.grad`` is None); one ``all_to_all``
   per shard group, in the widest floating dtype of its flat parameters,
   sends every piece of those parameters' values and reduced gradients to
   their owners ([Note: choosing owners] in owners.py). The
   owner points the parameter's ``.data`` and ``.grad`` at whole tensors of
   the original shape; every other rank hides the parameter from the
   optimizer by setting its ``.grad`` to None (torch's optimizers, and any
   that follows their convention, skip such parameters).
2. The optimizer's own ``step`` runs unchanged; its state for a parameter
   is created with the whole shape, on the owner only.
3. ``after_step``: one ``all_to_all`` per shard group sends the new values
   from the owners to the ranks holding pieces; every parameter shows its 1-D piece
   of the shard again, with the gradient it had.

A parameter the owner holds whole is stepped in place on a view of the
shard: nothing moves. Under NO_SHARD and one-rank groups that is every
parameter, so the step is the optimizer's own over reshaped views. A step
that raised leaves the exchange half done: ``settle`` (run by the
lifecycle's gate, before anything reads the parameters) shows the pieces and
gradients again, with the values of before the step. A closure (``step(fn)``)
would run forward and backward while parameters are whole, so it is refused;
LBFGS, which needs one, is refused anyway (runtime/optimizer_checks.py).
Pinned by tests/optim/test_owner_step.py.

[Note: the exchange in place]
Where the shard group's collectives go through shared memory (CPU ranks on
one host) and one dtype holds every flat parameter of the plan, the
exchange makes no send or receive buffer: ``comm.all_to_all_pieces``
writes each piece into the slots from where it lies (the shard's views,
the gradients) and reads each received piece straight into its place — on
the owner, the whole value and gradient, made before the collective; back
on the other ranks, their range of the shard. That saves a concatenation
and a copy out in each direction, and the buffers' bytes: on the bench's
Muon GPT (2 CPU ranks) the plan of ``optimizer.step()`` fell from 33.3 to
28.5 MB, and the exchange to owners measured 8-9 ms per step against 12-15
through buffers (separate runs). Elsewhere (gloo's messages, NCCL, mixed dtypes) the exchange goes
through one send and one receive buffer per direction, as below.
Pinned by tests/optim/test_owner_step.py
(test_the_exchange_in_place_and_through_buffers_match_one_process) and the
plan of each path by tests/planning/test_owner_optimizer_plan.py.

[Note: the exchange frees its buffers itself]
A collective's ``Work`` holds its own references to the tensors it was
given, and gloo drops them on its worker thread only after marking the work
complete, so ``wait()`` can return (and our last Python reference go) while
the buffer is still alive for a moment the scheduler decides: measured on a
busy two-core machine, the send and receive buffers outlived their use in
about one step of six, adding up to the whole exchange (460 KB on a 1.6 MB
model) to the step's transient bytes. So the exchange frees the storage
of each buffer it made (``comm.process_group.free_storage``: resized to zero bytes, which no holder
of a reference can delay) once its data has been used: the flags after the
all_reduce, the send buffer when the all_to_all returns, the receive buffer
when its pieces have been copied out. The plan (planning/owner_memory.py)
counts them for exactly those spans.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import comm
from ..comm.process_group import free_storage
from ..handle import FlatParamHandle
from ..runtime.optimizer_checks import flattens_parameters, is_elementwise
from ..runtime.state import UnitState
from .owners import OwnedParam, OwnerPlan, param_cost, pieces_of, plan_owners

__all__ = ["before_step", "after_step", "settle", "owner_plans", "StepTraffic", "last_step_traffic"]


@dataclass
class StepTraffic:
    """Elements one rank sent in the last owner step of an optimizer (for
    benchmarks and the plan): to owners, and back from them."""

    to_owners: int = 0
    from_owners: int = 0
    # Bytes, summed over dtypes.
    bytes_sent: int = 0


@dataclass
class _Exchange:
    """One group's parameters in flight through an optimizer step."""

    plan: OwnerPlan
    # Parameters with a gradient on some rank, in plan order.
    stepped: list[OwnedParam]
    # The gradient each parameter of the plan showed before the step.
    saved_grads: list[torch.Tensor | None]
    # Whether some piece moves (``_moves_pieces``), and whether it moves in
    # place ([Note: the exchange in place]): decided once, for both directions.
    moves: bool
    in_place: bool


# The owners of each optimizer's parameters, with the key they were made for.
_PLANS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple, list[OwnerPlan]]] = weakref.WeakKeyDictionary()
# Steps between before_step and after_step (a step that raised stays here
# until settle).
_IN_FLIGHT: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_Exchange]] = weakref.WeakKeyDictionary()
_TRAFFIC: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepTraffic] = weakref.WeakKeyDictionary()


def owner_plans(optimizer: torch.optim.Optimizer, units: list[UnitState]) -> list[OwnerPlan]:
    """The owners of ``optimizer``'s parameters of ``units``, one plan per
    shard group, made once per set of parameters ([Note: choosing owners])."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    key = (tuple(id(param) for param in params), tuple(unit.build_index for unit in units))
    cached = _PLANS.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    where: dict[int, tuple[UnitState, FlatParamHandle, int]] = {}
    for unit in units:
        for handle in unit.handles:
            for index, param in enumerate(handle.orig_params):
                where[id(param)] = (unit, handle, index)
    by_group: dict[int, list[tuple[nn.Parameter, UnitState, FlatParamHandle, int]]] = {}
    seen: set[int] = set()
    for param in params:
        if id(param) in where and id(param) not in seen:
            seen.add(id(param))
            unit, handle, index = where[id(param)]
            by_group.setdefault(id(handle.groups.shard_group), []).append((param, unit, handle, index))
    plans = [_plan_group(members) for members in by_group.values()]
    _PLANS[optimizer] = (key, plans)
    return plans


def _plan_group(members: list[tuple[nn.Parameter, UnitState, FlatParamHandle, int]]) -> OwnerPlan:
    groups = members[0][2].groups
    infos = [handle.layout.params[index] for _, _, handle, index in members]
    pieces = [pieces_of(handle.layout, info) for (_, _, handle, _), info in zip(members, infos)]
    costs = [param_cost(info.shape) for info in infos]
    owners = plan_owners(costs, pieces, groups.shard_world_size)
    owned = tuple(
        OwnedParam(param, handle, index, f"{unit.name_prefix}{info.fqn}", info.shape, piece, owner, cost)
        for (param, unit, handle, index), info, piece, owner, cost in zip(members, infos, pieces, owners, costs)
    )
    return OwnerPlan(groups.shard_group, groups.shard_rank, groups.shard_world_size, owned)


def before_step(optimizer: torch.optim.Optimizer, units: list[UnitState], args: tuple, kwargs: dict) -> None:
    """Bring every whole parameter of ``optimizer`` to its owner ([Note:
    owner computes]). Collective over each shard group involved."""
    if is_elementwise(optimizer) or flattens_parameters(optimizer):
        return
    plans = owner_plans(optimizer, units)
    if not any(plan.params for plan in plans):
        return
    _refuse_unsupported(optimizer, plans, args, kwargs)
    traffic = _TRAFFIC.setdefault(optimizer, StepTraffic())
    traffic.to_owners = traffic.from_owners = traffic.bytes_sent = 0
    exchanges = []
    try:
        for plan in plans:
            exchanges.append(_gather_to_owners(plan, traffic))
    except BaseException:
        _restore(exchanges)
        raise
    _IN_FLIGHT[optimizer] = exchanges


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """Send the stepped values back to the ranks holding pieces and show the
    pieces again. Collective over each shard group involved."""
    exchanges = _IN_FLIGHT.pop(optimizer, None)
    if exchanges is None:
        return
    traffic = _TRAFFIC.setdefault(optimizer, StepTraffic())
    try:
        for exchange in exchanges:
            _scatter_from_owners(exchange, traffic)
    finally:
        _restore(exchanges)


def settle() -> None:
    """Undo the exchange of any step that raised (values as before it)."""
    while _IN_FLIGHT:
        _, exchanges = _IN_FLIGHT.popitem()
        _restore(exchanges)


def last_step_traffic(optimizer: torch.optim.Optimizer) -> StepTraffic:
    """What this rank sent in ``optimizer``'s last owner step."""
    return _TRAFFIC.get(optimizer, StepTraffic())


# --------------------------------------------------------------------- checks
def _refuse_unsupported(optimizer: torch.optim.Optimizer, plans: list[OwnerPlan], args: tuple, kwargs: dict) -> None:
    name = type(optimizer).__name__
    # torch passes the step's own arguments, ``self`` first.
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:
        raise RuntimeError(
            f"{name}.step(closure) over parameters of fully_shard units: {name} is stepped on whole parameters by "
            "their owner ranks, and a closure would run forward and backward in the middle of that step. Call "
            "the closure (forward and backward) yourself, then optimizer.step(). Nothing was updated."
        )
    for plan in plans:
        for owned in plan.params:
            handle = owned.handle
            if handle.tp_specs[owned.index] is not None:
                raise RuntimeError(
                    f"{name}.step() over parameter '{owned.name}', a tensor-parallel DTensor of a fully_shard unit: "
                    f"{name} is not declared elementwise, so it must see whole parameters, and a tensor-parallel "
                    "parameter is whole only across the tensor-parallel ranks. Step it with an elementwise "
                    "optimizer (or declare one with register_elementwise_optimizer), or keep it out of the unit "
                    "(ignored_states). Nothing was updated."
                )
            if handle.offload_params and handle.compute_device.type != "cpu":
                raise RuntimeError(
                    f"{name}.step() over parameter '{owned.name}' of a unit with CPUOffload(offload_params=True): "
                    f"{name} steps whole parameters on owner ranks, which is not supported for offloaded shards "
                    "on an accelerator yet. Use an elementwise optimizer, or no offload. Nothing was updated."
                )


# ------------------------------------------------------------------ exchanges
def _gather_to_owners(plan: OwnerPlan, traffic: StepTraffic) -> _Exchange:
    rank = plan.rank
    flags = torch.tensor(
        [float(owned.param.grad is not None) for owned in plan.params], device=_device_of(plan)
    )
    if plan.world_size > 1:
        comm.all_reduce_max(flags, plan.group)
    stepped = [owned for owned, flag in zip(plan.params, flags.tolist()) if flag]
    moves = _moves_pieces(stepped)
    exchange = _Exchange(plan, stepped, [owned.param.grad for owned in plan.params], moves, _in_place(plan, moves))
    # What each rank sends: for every destination, its pieces of the
    # parameters that rank owns — value, then gradient.
    sends: list[list[torch.Tensor]] = [[] for _ in range(plan.world_size)]
    for owned in stepped:
        start, stop = owned.pieces[rank]
        if owned.owner != rank and stop > start:
            value, grad = _local_value_and_grad(owned)
            sends[owned.owner] += [value, grad]
    # The parameters this rank owns and assembles from pieces.
    assembled = [owned for owned in stepped if owned.owner == rank and not _held_whole(owned, rank)]
    buffer = None
    if exchange.in_place:  # the whole tensors receive the pieces
        wholes = {id(owned): _new_whole(owned) for owned in assembled}
        _exchange_in_place(plan, sends, _whole_pieces(plan, assembled, wholes), traffic, to_owners=True)
    else:  # the whole tensors are made once the receive buffer holds the pieces
        received, buffer = _exchange(plan, sends, _sizes_to_owner(plan, stepped), moves, traffic, to_owners=True)
        wholes = {id(owned): _new_whole(owned) for owned in assembled}
        for into, got in zip(_whole_pieces(plan, assembled, wholes), received):
            for piece, values in zip(into, got):
                piece.copy_(values)
    for owned in stepped:
        if owned.owner != rank:
            owned.param.grad = None  # hidden from this rank's optimizer
        else:
            _show_whole(owned, rank, wholes.get(id(owned)))
    free_storage(buffer)  # [Note: the exchange frees its buffers itself]
    free_storage(flags)
    return exchange


def _in_place(plan: OwnerPlan, moves: bool) -> bool:
    """Whether this exchange moves its pieces where they lie ([Note: the
    exchange in place]): some piece moves, the group's transport reads and
    writes in place, and one dtype holds every flat parameter of the plan.
    The same answer on every rank of the group."""
    if not moves or len({owned.handle.layout.dtype for owned in plan.params}) > 1:
        return False
    return comm.all_to_all_in_place(_device_of(plan), plan.group)


def _held_whole(owned: OwnedParam, rank: int) -> bool:
    start, stop = owned.pieces[rank]
    return stop - start == owned.numel


def _new_whole(owned: OwnedParam) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty 1-D whole value and gradient of ``owned``, in its flat
    parameter's dtype, on its device."""
    shard = owned.handle.sharded_flat_param
    return (
        torch.empty(owned.numel, dtype=shard.dtype, device=shard.device),
        torch.empty(owned.numel, dtype=shard.dtype, device=shard.device),
    )


def _whole_pieces(
    plan: OwnerPlan, assembled: list[OwnedParam], wholes: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Where each source rank's pieces land in the whole values and
    gradients of ``assembled``, in the order it sends them (per parameter,
    value then gradient)."""
    targets: list[list[torch.Tensor]] = [[] for _ in range(plan.world_size)]
    for owned in assembled:
        for source, (start, stop) in enumerate(owned.pieces):
            if source != plan.rank and stop > start:
                targets[source] += [whole[start:stop] for whole in wholes[id(owned)]]
    return targets


def _sizes_to_owner(plan: OwnerPlan, stepped: list[OwnedParam]) -> list[list[int]]:
    """Sizes of what this rank receives from each source rank, in order: a
    value piece and a gradient piece per parameter it owns."""
    sizes: list[list[int]] = [[] for _ in range(plan.world_size)]
    for owned in stepped:
        if owned.owner != plan.rank:
            continue
        for source, (start, stop) in enumerate(owned.pieces):
            if source != plan.rank and stop > start:
                sizes[source] += [stop - start] * 2
    return sizes


def _show_whole(owned: OwnedParam, rank: int, whole: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """On the owner: point the parameter's data and grad at whole tensors —
    views of the shard where it holds the parameter whole (``whole`` None:
    nothing moves), else ``whole``, the peers' pieces in it, with this
    rank's own piece copied in."""
    handle, param = owned.handle, owned.param
    whole_value, whole_grad = _local_value_and_grad(owned)
    if whole is not None:
        start, stop = owned.pieces[rank]
        whole[0][start:stop].copy_(whole_value)
        whole[1][start:stop].copy_(whole_grad)
        whole_value, whole_grad = whole
    param.grad = None
    handle.show_local_data(owned.index, whole_value.view(owned.shape), full=True)
    param.grad = whole_grad.view(owned.shape).to(_grad_dtype(handle))


def _scatter_from_owners(exchange: _Exchange, traffic: StepTraffic) -> None:
    plan, rank = exchange.plan, exchange.plan.rank
    sends: list[list[torch.Tensor]] = [[] for _ in range(plan.world_size)]
    for owned in exchange.stepped:
        if owned.owner != rank:
            continue
        new_value = owned.param.detach().reshape(-1)
        for target, (start, stop) in enumerate(owned.pieces):
            if stop <= start:
                continue
            if target == rank:
                local = owned.handle.local_shard_view(owned.handle.layout.params[owned.index])
                if local.data_ptr() != new_value[start:stop].data_ptr():
                    local.copy_(new_value[start:stop])
            else:
                sends[target].append(new_value[start:stop])
    # Where each piece this rank holds of a parameter stepped elsewhere goes, by owner.
    pieces: list[list[torch.Tensor]] = [[] for _ in range(plan.world_size)]
    for owned in exchange.stepped:
        start, stop = owned.pieces[rank]
        if owned.owner != rank and stop > start:
            pieces[owned.owner].append(owned.handle.local_shard_view(owned.handle.layout.params[owned.index]))
    if exchange.in_place:
        _exchange_in_place(plan, sends, pieces, traffic, to_owners=False)  # into the shard itself
        return
    sizes = [[piece.numel() for piece in from_owner] for from_owner in pieces]
    received, buffer = _exchange(plan, sends, sizes, exchange.moves, traffic, to_owners=False)
    for from_owner, received_from in zip(pieces, received):
        for piece, new_values in zip(from_owner, received_from):
            piece.copy_(new_values)
    free_storage(buffer)  # [Note: the exchange frees its buffers itself]


def _moves_pieces(stepped: list[OwnedParam]) -> bool:
    """Whether some stepped parameter has a piece off its owner. Derived from
    the plan and the shared flags, so every rank of the group agrees on
    whether the collective runs."""
    return any(
        stop > start and source != owned.owner
        for owned in stepped
        for source, (start, stop) in enumerate(owned.pieces)
    )


def _exchange(
    plan: OwnerPlan, sends: list[list[torch.Tensor]], receive_sizes: list[list[int]], moves_pieces: bool,
    traffic: StepTraffic, *, to_owners: bool,
) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    """One ``all_to_all`` carrying each rank's list of tensors to each rank,
    in the widest floating dtype of the group's flat parameters (a narrower
    one round-trips through it exactly): the pieces received from each rank
    (views of the receive buffer) and that buffer, for the caller to
    ``free_storage`` once it has copied them out (the send buffer is freed here)."""
    received: list[list[torch.Tensor]] = [[] for _ in range(plan.world_size)]
    if plan.world_size == 1 or not moves_pieces:
        return received, None
    dtype, device = _dtype_of(plan), _device_of(plan)
    input_splits = [sum(t.numel() for t in tensors) for tensors in sends]
    output_splits = [sum(sizes) for sizes in receive_sizes]
    flat_in = torch.cat([t.reshape(-1).to(dtype) for tensors in sends for t in tensors]) if sum(input_splits) else (
        torch.empty(0, dtype=dtype, device=device)
    )
    flat_out = torch.empty(sum(output_splits), dtype=dtype, device=device)
    comm.all_to_all(flat_out, flat_in, output_splits, input_splits, plan.group)
    sent = sum(input_splits)
    element_size = flat_in.element_size()
    free_storage(flat_in)  # [Note: the exchange frees its buffers itself]
    if to_owners:
        traffic.to_owners += sent
    else:
        traffic.from_owners += sent
    traffic.bytes_sent += sent * element_size
    offset = 0
    for source, sizes in enumerate(receive_sizes):
        for size in sizes:
            received[source].append(flat_out[offset : offset + size])
            offset += size
    return received, flat_out


def _exchange_in_place(
    plan: OwnerPlan, sends: list[list[torch.Tensor]], targets: list[list[torch.Tensor]], traffic: StepTraffic,
    *, to_owners: bool,
) -> None:
    """One ``all_to_all`` from each rank's list of tensors for each rank
    straight into the tensors ``targets`` names for what each rank sends
    here ([Note: the exchange in place]; one dtype, so no conversion)."""
    # An empty tensor first in each list: its dtype, where a rank moves nothing.
    dtype = _dtype_of(plan)
    empty = torch.empty(0, dtype=dtype, device=_device_of(plan))
    inputs = [empty, *(tensor.reshape(-1) for tensors in sends for tensor in tensors)]
    outputs = [empty, *(tensor for tensors in targets for tensor in tensors)]
    input_splits = [sum(t.numel() for t in tensors) for tensors in sends]
    output_splits = [sum(t.numel() for t in tensors) for tensors in targets]
    comm.all_to_all_pieces(outputs, inputs, output_splits, input_splits, plan.group)
    sent = sum(input_splits)
    if to_owners:
        traffic.to_owners += sent
    else:
        traffic.from_owners += sent
    traffic.bytes_sent += sent * dtype.itemsize


def _restore(exchanges: list[_Exchange]) -> None:
    """Every parameter of ``exchanges`` shows its piece of the shard and the
    gradient it had before the step."""
    for exchange in exchanges:
        for owned in exchange.plan.params:
            owned.param.grad = None
        for handle in {id(owned.handle): owned.handle for owned in exchange.plan.params}.values():
            handle.use_sharded_views()
        for owned, grad in zip(exchange.plan.params, exchange.saved_grads):
            owned.param.grad = grad


def _local_value_and_grad(owned: OwnedParam) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of the parameter and of its gradient (zeros where
    it holds no gradient), 1-D, in the flat parameter's dtype."""
    handle = owned.handle
    value = handle.local_shard_view(handle.layout.params[owned.index])
    grad = owned.param.grad
    if grad is None:
        return value, torch.zeros_like(value)
    return value, grad.detach().reshape(-1).to(value.dtype)


def _grad_dtype(handle: FlatParamHandle) -> torch.dtype:
    return handle.reduce_dtype if handle.keep_low_precision_grads else handle.layout.dtype


def _dtype_of(plan: OwnerPlan) -> torch.dtype:
    return functools.reduce(torch.promote_types, {owned.handle.layout.dtype for owned in plan.params})


def _device_of(plan: OwnerPlan) -> torch.device:
    return plan.params[0].handle.sharded_flat_param.device
