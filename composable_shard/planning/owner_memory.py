"""Owns: the plan's memory of optimizers stepped whole on owner ranks
([Note: owner computes] in optim/owner_step.py) — which rank owns each
parameter, the state each owner keeps whole, and the step's transient bytes.

Knows nothing of: process groups, hooks, the exchange's code (it replays
what the exchange and the optimizer allocate, from the plan's layouts).

Public names: ``OwnerOptimizer``, ``owner_optimizer``, ``OWNER_OPTIMIZERS``,
``owner_state_bytes``, ``owner_step_bytes``, ``muon_tensor_bytes``,
``planned_owners``.

[Note: owner-stepped optimizers, planned]
The owners are the runtime's: ``optim/owners.py``'s ``pieces_of``,
``param_cost`` and ``plan_owners`` on the layouts the plan computed with
``fully_shard``'s code, over the optimizer's parameters in
``module.parameters()`` order (an optimizer built from it: every parameter,
frozen ones too, for they weigh in the balance), one plan per shard group
(FULL_SHARD and SHARD_GRAD_OP units share the world group, hybrid units
their shard group, NO_SHARD units none). Per rank it counts:

- state: whole tensors for each trainable parameter this rank owns, none
  for the others (Muon's ``momentum_buffer``; Adafactor's ``row_var`` and
  ``col_var`` for a matrix, ``variance`` for a vector, and a float32
  ``step``; ``k`` parameter-shaped tensors for ``("owner", k)``), in the
  gradient's dtype. ``"muon"`` steps the 2-D parameters (torch's Muon
  refuses others) and plans AdamW, elementwise on the shards, for the rest.
- ``optimizer.step()``'s transients, the worst of: the all_to_all to owners
  (the flags, its send and receive buffers; in place, through shared
  memory, none: the whole values and gradients it fills instead), the
  whole values and gradients being assembled (with the receive buffer), the
  optimizer's own step of
  the owned parameters in order (its temporaries replayed from torch's
  single-tensor code, Python loop variables kept until reassigned), the
  all_to_all back (send and receive buffers; none in place) — each beside the whole values
  and gradients this rank assembled for parameters it does not hold whole
  (made fresh each step, freed as the pieces are shown again) — and,
  for ``"muon"``, AdamW's step afterwards. Each exchange buffer is counted
  from its making to its last use, where the exchange frees it itself,
  whatever still references it ([Note: the exchange frees its buffers
  itself] in optim/owner_step.py: gloo's worker thread can hold them past
  ``wait()``, which once made a warm worker's step measure up to 1.6x this).

Not counted: the scratch a matrix product allocates inside its library
(oneDNN's packed operands for Newton-Schulz's bf16 products on CPU: one to
several bf16 copies of the matrix, by kernel, shape and thread count, so no
formula of the shape holds), scalars of a few bytes, a user optimizer's own temporaries (``("owner", k)``), and
conversions the exchange makes for flat parameters of mixed dtypes or kept
low-precision gradients. Pinned by tests/planning/test_owner_optimizer_plan.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..api import ShardingStrategy
from ..optim.owners import param_cost, pieces_of, plan_owners
from .memory import UnitPlan

__all__ = [
    "OwnerOptimizer",
    "owner_optimizer",
    "OWNER_OPTIMIZERS",
    "owner_state_bytes",
    "owner_step_bytes",
    "muon_tensor_bytes",
    "planned_owners",
]

# Owner-stepped optimizer kinds the plan knows by name, with their state.
OWNER_OPTIMIZERS = {
    "muon": ("momentum_buffer", "exp_avg", "exp_avg_sq", "step"),  # + AdamW on the rest
    "adafactor": ("row_var", "col_var", "variance", "step"),
}
# torch.optim keeps ``step`` as a float32 scalar tensor per parameter.
_STEP_BYTES = 4


@dataclass(frozen=True)
class OwnerOptimizer:
    """An optimizer the runtime steps whole on owner ranks, as planned."""

    # "muon", "adafactor", or "owner" (a user's own).
    kind: str
    # "owner": tensors shaped like the parameter it keeps per parameter.
    state_per_param: int = 0

    @property
    def label(self) -> str:
        return f"owner x{self.state_per_param}" if self.kind == "owner" else self.kind

    def steps_whole(self, shape: torch.Size) -> bool:
        """Whether this optimizer (not its elementwise companion) steps a
        parameter of ``shape``."""
        return len(shape) == 2 if self.kind == "muon" else True


def owner_optimizer(optimizer: Any) -> OwnerOptimizer | None:
    """The owner-stepped optimizer ``optimizer`` names (``"muon"``,
    ``"adafactor"``, ``("owner", k)``), None for any other value."""
    if isinstance(optimizer, str) and optimizer in OWNER_OPTIMIZERS:
        return OwnerOptimizer(optimizer)
    if (
        isinstance(optimizer, tuple)
        and len(optimizer) == 2
        and optimizer[0] == "owner"
        and isinstance(optimizer[1], int)
        and not isinstance(optimizer[1], bool)
        and optimizer[1] >= 0
    ):
        return OwnerOptimizer("owner", optimizer[1])
    return None


@dataclass(frozen=True)
class _Param:
    """One parameter of a unit on this rank, as the owner step sees it."""

    position: int  # in module.parameters()
    shape: torch.Size
    pieces: tuple[tuple[int, int], ...]
    group: str
    shard_rank: int
    shard_world_size: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    requires_grad: bool
    local_numel: int
    offload: bool
    # Its group's collectives go through shared memory (the exchange in place).
    shared_memory: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def piece(self, rank: int) -> int:
        start, stop = self.pieces[rank]
        return stop - start


@dataclass(frozen=True)
class _Owned:
    """A parameter stepped whole, with its owner."""

    param: _Param
    owner: int


def _group_key(strategy: ShardingStrategy) -> str:
    """Units sharing one shard group (fully_shard._resolve_groups with the
    default process group)."""
    if strategy is ShardingStrategy.NO_SHARD:
        return "none"
    return "hybrid" if strategy.is_hybrid else "world"


def _params(units: Sequence[UnitPlan]) -> list[_Param]:
    """Every parameter of ``units`` in ``module.parameters()`` order."""
    params = []
    for unit in units:
        for fp in unit.flat_params:
            if fp.layout is None:
                raise AssertionError(f"plan: unit '{unit.name}' was planned without its layouts")
            for info, position in zip(fp.layout.params, fp.param_positions):
                params.append(
                    _Param(
                        position, info.shape, pieces_of(fp.layout, info), _group_key(unit.strategy),
                        fp.layout.shard_rank, fp.layout.shard_world_size, fp.dtype, fp.grad_dtype,
                        fp.requires_grad, info.local_numel, fp.offload, fp.reduction_frees_grad,
                    )
                )
    return sorted(params, key=lambda p: p.position)


def _owner_groups(units: Sequence[UnitPlan], spec: OwnerOptimizer) -> list[list[_Owned]]:
    """The owner plan of each shard group, in the runtime's order
    ([Note: choosing owners] in optim/owners.py)."""
    by_group: dict[str, list[_Param]] = {}
    for param in _params(units):
        if spec.steps_whole(param.shape):
            by_group.setdefault(param.group, []).append(param)
    groups = []
    for members in by_group.values():
        owners = plan_owners(
            [param_cost(p.shape) for p in members], [p.pieces for p in members], members[0].shard_world_size
        )
        groups.append([_Owned(p, owner) for p, owner in zip(members, owners)])
    return groups


def planned_owners(units: Sequence[UnitPlan], spec: OwnerOptimizer) -> dict[int, int]:
    """Position in ``module.parameters()`` -> owner (shard group rank) of
    every parameter ``spec`` steps whole, as the runtime will choose it."""
    return {owned.param.position: owned.owner for group in _owner_groups(units, spec) for owned in group}


def _whole_state(param: _Param, spec: OwnerOptimizer) -> dict[str, int]:
    """The state ``spec`` keeps for a whole ``param`` on its owner."""
    size = param.grad_dtype.itemsize
    if spec.kind == "muon":
        return {"momentum_buffer": param.numel * size}
    if spec.kind == "owner":
        return {"state": spec.state_per_param * param.numel * size}
    shape = param.shape
    if len(shape) > 1:
        return {
            "row_var": param.numel // shape[-1] * size,
            "col_var": param.numel // shape[-2] * size,
            "step": _STEP_BYTES,
        }
    return {"variance": param.numel * size, "step": _STEP_BYTES}


def owner_state_bytes(units: Sequence[UnitPlan], spec: OwnerOptimizer, *, offloaded_only: bool = False) -> dict[str, int]:
    """Optimizer state by kind on this rank ([Note: owner-stepped
    optimizers, planned]); ``offloaded_only``: of CPU-offloaded units."""
    kinds = dict.fromkeys(OWNER_OPTIMIZERS.get(spec.kind, ("state",)), 0)
    for group in _owner_groups(units, spec):
        for owned in group:
            param = owned.param
            if param.requires_grad and owned.owner == param.shard_rank and (param.offload or not offloaded_only):
                for kind, size in _whole_state(param, spec).items():
                    kinds[kind] += size
    if spec.kind == "muon":  # AdamW on the shards of the other parameters
        for param in _params(units):
            if param.requires_grad and not spec.steps_whole(param.shape) and (param.offload or not offloaded_only):
                # Every trainable parameter gets a .grad (empty where this
                # rank holds none of it), so AdamW keeps a step for each.
                kinds["exp_avg"] += param.local_numel * param.dtype.itemsize
                kinds["exp_avg_sq"] += param.local_numel * param.dtype.itemsize
                kinds["step"] += _STEP_BYTES
    return kinds


def owner_step_bytes(units: Sequence[UnitPlan], spec: OwnerOptimizer, device_type: str) -> int:
    """The transients of ``optimizer.step()`` on this rank ([Note:
    owner-stepped optimizers, planned])."""
    groups = _owner_groups(units, spec)
    exchanges = [_exchange_bytes(group) for group in groups]
    wholes = sum(whole for _, _, whole, _ in exchanges)
    worst = 0
    assembled = 0  # whole tensors of the groups gathered before
    for to_owners, building, whole, _ in exchanges:
        worst = max(worst, assembled + to_owners, assembled + building + whole)
        assembled += whole
    owned = [
        owned.param for group in groups for owned in group
        if owned.param.requires_grad and owned.owner == owned.param.shard_rank
    ]
    owned.sort(key=lambda p: p.position)  # the optimizer's order
    worst = max(worst, wholes + _own_step_bytes(owned, spec, device_type))
    for _, _, _, from_owners in exchanges:
        worst = max(worst, wholes + from_owners)
    if spec.kind == "muon":
        worst = max(worst, _adamw_step_bytes(units, spec, device_type))
    return worst


def _exchange_bytes(group: list[_Owned]) -> tuple[int, int, int, int]:
    """One shard group's exchange on this rank: (the all_to_all to owners,
    the receive buffer while whole tensors are assembled, the whole values
    and gradients assembled, the all_to_all back) in bytes. In place
    ([Note: the exchange in place] in optim/owner_step.py) the whole
    tensors exist from before the all_to_all to owners, and nothing else."""
    rank, world = group[0].param.shard_rank, group[0].param.shard_world_size
    flags = 4 * len(group)  # one float32 flag per parameter of the plan
    stepped = [owned for owned in group if owned.param.requires_grad]
    moves = world > 1 and any(
        owned.param.piece(source) and source != owned.owner for owned in stepped for source in range(world)
    )
    dtypes = {owned.param.dtype for owned in group}
    size = functools.reduce(torch.promote_types, dtypes).itemsize
    sent = received = sent_back = received_back = whole = 0
    for owned in stepped:
        param = owned.param
        if owned.owner != rank:
            sent += 2 * param.piece(rank)  # value and gradient
            received_back += param.piece(rank)
            continue
        others = sum(param.piece(source) for source in range(world) if source != rank)
        received += 2 * others
        sent_back += others
        if param.piece(rank) != param.numel:  # assembled, not a view of the shard
            whole += 2 * param.numel * param.dtype.itemsize  # value and gradient
    if not moves:
        return flags, flags, whole, 0
    if len(dtypes) == 1 and group[0].param.shared_memory:
        return flags + whole, flags, whole, 0
    return flags + (sent + received) * size, flags + received * size, whole, (sent_back + received_back) * size


def _own_step_bytes(owned: list[_Param], spec: OwnerOptimizer, device_type: str) -> int:
    """The optimizer's own step over the parameters this rank owns."""
    if spec.kind == "muon":
        return _muon_step_bytes(owned, device_type)
    if spec.kind == "adafactor":
        return _adafactor_step_bytes(owned)
    return 0  # a user's optimizer: its temporaries are its own


class _Loop:
    """Live temporaries of an optimizer's per-parameter loop: each named
    local keeps its tensor until reassigned, as Python does."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak = 0

    def assign(self, name: str, nbytes: int) -> None:
        """``name = <new tensor of nbytes>``: both exist while it is made."""
        self.peak = max(self.peak, sum(self.live.values()) + nbytes)
        self.live[name] = nbytes

    def moment(self, nbytes: int) -> None:
        """A temporary of ``nbytes`` alive beside the locals, then freed."""
        self.peak = max(self.peak, sum(self.live.values()) + nbytes)


def _muon_step_bytes(owned: list[_Param], device_type: str) -> int:
    """torch.optim.Muon's single-tensor step (nesterov, its default): the
    Nesterov update in the gradient dtype, Newton-Schulz's bf16 iterate,
    Gram matrix and its update (both kept until reassigned) and the next
    iterate, then the parameter's in-place add (on CPU through a copy of the
    bf16 update in the parameter's dtype)."""
    loop = _Loop()
    for param in owned:
        rows, cols = param.shape
        small = min(rows, cols)
        numel, bf16 = param.numel, 2
        loop.assign("update", numel * param.grad_dtype.itemsize)  # grad.lerp(buf)
        iterate = numel * bf16
        gram = small * small * bf16
        # In Newton-Schulz: the iterate, then per iteration a Gram matrix and
        # its update beside the previous ones, and the next iterate.
        loop.moment(iterate + max(3 * gram, 2 * gram + iterate))
        loop.assign("update", iterate)  # the fp32 update freed on return
        if device_type == "cpu" and param.dtype != torch.bfloat16:
            loop.moment(numel * param.dtype.itemsize)
    return loop.peak


def muon_tensor_bytes(shape: torch.Size, dtype: torch.dtype = torch.float32, device_type: str = "cpu") -> int:
    """The planned temporaries of torch.optim.Muon stepping one whole
    parameter of ``shape`` (the tensors its code names; not the matrix
    products' own workspace)."""
    param = _Param(0, shape, (), "", 0, 1, dtype, dtype, True, math.prod(shape), False, False)
    return _muon_step_bytes([param], device_type)


def _adafactor_step_bytes(owned: list[_Param]) -> int:
    """torch.optim.Adafactor's single-tensor step (its default unless
    ``foreach=True``): a matrix's row and column means, then its variance
    estimate (the update, in place); a vector's squared gradient and its
    variance's copy."""
    loop = _Loop()
    for param in owned:
        size, shape = param.grad_dtype.itemsize, param.shape
        if len(shape) > 1:
            loop.assign("row_mean", param.numel // shape[-1] * size)
            loop.assign("col_mean", param.numel // shape[-2] * size)
            loop.assign("var_estimate", param.numel * size)
        else:
            loop.assign("grad_squared", param.numel * size)
            loop.assign("var_estimate", param.numel * size)
    return loop.peak


def _adamw_step_bytes(units: Sequence[UnitPlan], spec: OwnerOptimizer, device_type: str) -> int:
    """AdamW's step over the shards of the parameters Muon does not take:
    its foreach path (CUDA) one temporary per parameter at once, its
    single-tensor path (CPU) two for the largest (as memory.py plans it)."""
    sizes = [
        p.local_numel * p.dtype.itemsize for p in _params(units) if p.requires_grad and not spec.steps_whole(p.shape)
    ]
    if device_type == "cuda":
        return sum(sizes)
    return 2 * max(sizes, default=0)
