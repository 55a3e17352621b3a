"""Owns: the per-rank memory arithmetic of a sharding plan — what one flat
parameter costs in each state, the optimizer state per kind, the sizes the
allocator and gloo see. The step's replay is ``step_replay.py``;
activations are measured in ``activations.py``.

Knows nothing of: process groups, hooks, how units are chosen (``sharding_plan.py``
gives it finished ``FlatParamPlan``/``UnitPlan`` descriptions).

Public names: ``FlatParamPlan``, ``UnitPlan``, ``optimizer_bytes``,
``optimizer_step_bytes``, ``in_backward_step_bytes``, ``OPTIMIZERS``,
``freed_allocation_sizes``, ``gloo_buffer_sizes``.

The plan counts live tensors; on CPU the resident set follows them because
the backward trims the C heap ([Note: trimming the host heap in backward]
in runtime/host_memory.py). Pinned by tests/plan/test_plan.py (the plan against the
allocator's bytes and the step's profiled peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import comm
from ..api import BackwardPrefetch, ShardingStrategy
from ..handle.layout import FlatParamLayout
from ..optim.flat_runs import flat_runs, flat_step_enabled

__all__ = [
    "OPTIMIZERS",
    "FlatParamPlan",
    "UnitPlan",
    "optimizer_bytes",
    "optimizer_step_bytes",
    "in_backward_step_bytes",
    "freed_allocation_sizes",
    "gloo_buffer_sizes",
]

# Optimizer kinds the plan knows, with the per-parameter state each keeps.
OPTIMIZERS = {
    "adamw": ("exp_avg", "exp_avg_sq", "step"),
    "adam": ("exp_avg", "exp_avg_sq", "step"),
    "sgd": ("momentum_buffer",),
    "none": (),
}
# torch.optim's Adam keeps ``step`` as a float32 scalar tensor per parameter.
_STEP_BYTES = 4


@dataclass(frozen=True)
class FlatParamPlan:
    """One flat parameter on this rank, as ``fully_shard`` builds it."""

    dtype: torch.dtype
    requires_grad: bool
    # Elements of the original parameters (each once, tied ones included).
    numel: int
    # Numel of the padded unsharded flat buffer.
    padded_numel: int
    # Numel of one rank's shard.
    shard_numel: int
    # Parameter elements (not padding) in this rank's shard.
    local_numel: int
    # Parameters with at least one element on this rank (they get a .grad
    # and optimizer state; the others' local part is empty).
    local_param_count: int
    # Largest local part of one parameter (single-tensor optimizer temporaries).
    max_local_numel: int
    # Compute / all-gather dtype, reduction dtype, sharded gradient dtype.
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype
    # Whether the unsharded buffer is its own allocation (see handle/storage.py).
    needs_unshard_storage: bool
    # Whether the shard, its gradient and optimizer state live on the CPU.
    offload: bool
    is_sharded: bool
    param_count: int
    # Sum over parameters registered k > 1 times of k * numel: autograd holds
    # one gradient per use plus their sum before the flat gradient exists.
    tied_use_numel: int = 0
    # Whether the reduction copies the padded gradient out when it is issued
    # (shared memory on CPU), so the gradient is freed then, not at the wait.
    reduction_frees_grad: bool = False
    # Whether the all-gather runs through gloo's messages on CPU (not shared
    # memory): gloo gathers into a flat copy of the whole output of its own,
    # freed when the collective completes.
    all_gather_copies_output: bool = False
    # (module pre-order index of the parameter's last registration, numel)
    # per parameter: a parameter registered after a unit is used after it in
    # forward, so its gradient exists before that unit's backward.
    last_uses: tuple[tuple[int, int], ...] = ()
    # The layout it was computed from, and each parameter's position in
    # ``module.parameters()`` (the order an optimizer built from it sees):
    # what owner-stepped optimizers are planned from (owner_memory.py).
    layout: FlatParamLayout | None = field(default=None, compare=False, repr=False)
    param_positions: tuple[int, ...] = field(default=(), compare=False, repr=False)
    # What ``_stepped_tensors`` and ``freed_allocation_sizes`` found, by
    # whether the flat step is on: a budget's search plans the same flat
    # parameter thousands of times.
    _stepped: dict[bool, list[tuple[int, int, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _freed: dict[bool, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def padding(self) -> int:
        """Alignment and tail padding elements of the unsharded buffer."""
        return self.padded_numel - self.numel

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self.dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """The sharded gradient after backward: one flat tensor, or none when
        this rank holds no element of any parameter."""
        if not self.requires_grad or self.local_param_count == 0:
            return 0
        return self.shard_numel * self.grad_dtype.itemsize

    @property
    def unsharded_bytes(self) -> int:
        return self.padded_numel * self.param_dtype.itemsize if self.needs_unshard_storage else 0

    @property
    def gathers_in_place(self) -> bool:
        """Whether a coalesced all-gather reads and writes this shard where
        it lies: the group's collectives go through shared memory (as
        ``reduction_frees_grad`` says) and the shard needs no cast
        (``comm.all_gather_together``)."""
        return self.reduction_frees_grad and self.dtype == self.param_dtype

    @property
    def reduces_in_place(self) -> bool:
        """Whether a coalesced reduction reads this gradient where it lies
        and gives its shard a tensor of its own: the group's collectives go
        through shared memory, as ``reduction_frees_grad`` says
        (``comm.reduce_grads_together``)."""
        return self.reduction_frees_grad

    @property
    def gather_source_bytes(self) -> int:
        """A temporary copy of the shard in the compute dtype/device for the
        all-gather (mixed precision or offload)."""
        if self.param_dtype == self.dtype and not self.offload:
            return 0
        return self.shard_numel * self.param_dtype.itemsize

    @property
    def all_gather_copy_bytes(self) -> int:
        """gloo's own flat output of an all-gather in flight (CPU, message
        path): the padded unsharded size."""
        if not (self.all_gather_copies_output and self.is_sharded):
            return 0
        return self.padded_numel * self.param_dtype.itemsize

    @property
    def unsharded_grad_bytes(self) -> int:
        return self.padded_numel * self.param_dtype.itemsize if self.requires_grad else 0

    @property
    def grad_pieces_bytes(self) -> int:
        """Per-parameter gradients autograd holds before it concatenates them
        into the padded flat gradient."""
        return self.numel * self.param_dtype.itemsize if self.requires_grad else 0

    def grad_bytes_used_after(self, module_index: int) -> int:
        """Gradient pieces of parameters last registered after
        ``module_index`` (held by autograd while that module's backward
        runs)."""
        if not self.requires_grad:
            return 0
        numel = sum(n for last, n in self.last_uses if last > module_index)
        return numel * self.param_dtype.itemsize

    @property
    def tied_grad_bytes(self) -> int:
        """While a tied parameter's gradients are summed: one per use besides
        the piece already counted, and the sum."""
        return self.tied_use_numel * self.param_dtype.itemsize if self.requires_grad else 0

    @property
    def conversion_bytes(self) -> int:
        """The unsharded gradient in the compute dtype while it is copied to
        the reduction dtype."""
        return self.unsharded_grad_bytes if self.reduce_dtype != self.param_dtype else 0

    @property
    def reduction_issue_bytes(self) -> int:
        """Buffers of this flat parameter's reduction when it is issued: the
        padded gradient and the output."""
        if not self.requires_grad:
            return 0
        size = self.reduce_dtype.itemsize
        output = self.shard_numel * size if self.is_sharded else 0
        return self.padded_numel * size + output

    @property
    def reduction_holds_grad_bytes(self) -> int:
        """The padded gradient a reduction in flight keeps (none through
        shared memory, which copied it out when issued)."""
        if not self.requires_grad or (self.reduction_frees_grad and self.is_sharded):
            return 0
        return self.padded_numel * self.reduce_dtype.itemsize

    @property
    def reduction_kept_at_finish_bytes(self) -> int:
        """What a finished reduction still keeps, besides the sharded
        gradient it became, while its finish (and the user's hooks) run:
        the output if cast to the gradient dtype (``comm.finish_grad_reduction``).
        Its inputs (the padded gradient, its cast) were dropped at the wait
        (``Scheduler._finish_reduction``)."""
        if not self.requires_grad or self.grad_dtype == self.reduce_dtype:
            return 0
        return self.shard_numel * self.reduce_dtype.itemsize

    def bucket_key(self, bucket_bytes: int) -> tuple | None:
        """The bucket its reduction joins ([Note: coalesced reductions] in
        runtime/grad_buckets.py; ``bucket_bytes`` 0: none), or None where it
        is reduced alone."""
        if not self.requires_grad or self.offload:
            return None
        if not comm.bucketable_bytes(self.padded_numel, self.reduce_dtype, bucket_bytes):
            return None
        return (self.is_sharded, self.reduce_dtype)

    def gather_key(self, bucket_bytes: int) -> tuple | None:
        """The bucket its all-gather joins ([Note: coalesced all-gathers] in
        runtime/gather_buckets.py; ``bucket_bytes`` 0: none), or None where
        it is gathered alone."""
        if not self.is_sharded or self.offload or not self.needs_unshard_storage:
            return None
        if not comm.gatherable_bytes(self.padded_numel, self.param_dtype, bucket_bytes):
            return None
        return (self.param_dtype,)

    @property
    def reduction_bytes(self) -> int:
        """Buffers of this flat parameter's reduction while it is in flight
        (after the issue)."""
        if self.reduction_frees_grad and self.is_sharded and self.requires_grad:
            return self.shard_numel * self.reduce_dtype.itemsize
        return self.reduction_issue_bytes


@dataclass(frozen=True)
class UnitPlan:
    """One unit: its name in the model (``""`` for the root) and its flat
    parameters on this rank."""

    name: str
    module_type: str
    strategy: ShardingStrategy
    flat_params: tuple[FlatParamPlan, ...]
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch | None
    # Pre-order index of the last module in the unit's subtree.
    subtree_last: int = 0
    # ``bytes_of``'s sums by attribute: a budget's search replays the same
    # unit in thousands of plans (the plan is immutable, so is each sum).
    _sums: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return sum(fp.numel for fp in self.flat_params)

    @property
    def padded_numel(self) -> int:
        return sum(fp.padded_numel for fp in self.flat_params)

    @property
    def shard_numel(self) -> int:
        return sum(fp.shard_numel for fp in self.flat_params)

    @property
    def shard_bytes(self) -> int:
        return sum(fp.shard_bytes for fp in self.flat_params)

    @property
    def padding(self) -> int:
        return sum(fp.padding for fp in self.flat_params)

    def bytes_of(self, attr: str) -> int:
        total = self._sums.get(attr)
        if total is None:
            total = self._sums[attr] = sum(getattr(fp, attr) for fp in self.flat_params)
        return total

    def bucket_key(self, bucket_bytes: int) -> tuple | None:
        """The bucket the unit's reductions join, or None where they run
        alone: the plan holds a unit's trainable flat parameters together,
        so a unit is bucketed when all of them share one key."""
        trainable = [fp for fp in self.flat_params if fp.requires_grad]
        keys = {fp.bucket_key(bucket_bytes) for fp in trainable}
        if len(keys) != 1 or None in keys:
            return None
        return keys.pop()

    def gather_key(self, bucket_bytes: int) -> tuple | None:
        """The bucket the unit's all-gathers join, or None where they run
        alone: all its gathered flat parameters must share one key (its
        strategy's shard group is part of it)."""
        keys = {fp.gather_key(bucket_bytes) for fp in self.flat_params if fp.needs_unshard_storage}
        key = keys.pop() if len(keys) == 1 else None
        return None if key is None else (self.strategy.is_hybrid, *key)

    def is_ancestor_of(self, other: UnitPlan) -> bool:
        return other is not self and (self.name == "" or other.name.startswith(self.name + "."))


def optimizer_bytes(flat_params: Sequence[FlatParamPlan], optimizer: str) -> dict[str, int]:
    """Optimizer state by kind, as ``torch.optim`` allocates it for the
    original parameters' local parts (padding gets none)."""
    kinds = dict.fromkeys(OPTIMIZERS[optimizer], 0)
    for fp in flat_params:
        if not fp.requires_grad:
            continue
        for kind in kinds:
            if kind == "step":
                # Every trainable parameter gets a .grad, empty where this rank
                # holds none of it ([Note: empty gradients on empty ranges]),
                # so torch.optim keeps a step for each (the flat step too).
                kinds[kind] += _STEP_BYTES * fp.param_count
            elif kind == "momentum_buffer":
                kinds[kind] += fp.local_numel * fp.grad_dtype.itemsize
            else:
                kinds[kind] += fp.local_numel * fp.dtype.itemsize
    return kinds


# [Note: Adam's single-tensor step, planned]
# torch.optim's Adam and AdamW on CPU (no foreach) step one parameter after
# the other: ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``,
# then ``param.addcdiv_(exp_avg, denom, ...)``. Dividing by a Python float
# wraps it as a 0-dim float64 tensor and casts that to the parameter's dtype;
# while the quotient is allocated, the square root, both scalars and the
# previous parameter's ``denom`` (the loop's variable, rebound only after)
# are alive. The worst of that over the tensors stepped, in the optimizer's
# order (``module.parameters()``'s: ``FlatParamPlan.param_positions``), is
# the step's temporaries; a tensor is a run of parameters that lie back to
# back in the shard ([Note: the flat step] in optim/flat_step.py: its
# temporaries are the run's), else a parameter. One parameter's optimizer
# in its hook has no previous one. Checked against the allocator by tests/planning/test_plan.py.
_WRAPPED_FLOAT_BYTES = 8


def _local_params(fp: FlatParamPlan) -> list[tuple[int, int, int]]:
    """(position in ``module.parameters()``, local bytes, item size) of each
    parameter of a trainable flat parameter on this rank (one entry of the
    largest local part where the layout is not known)."""
    size = fp.dtype.itemsize
    if fp.layout is None or len(fp.param_positions) != len(fp.layout.params):
        return [(0, fp.max_local_numel * size, size)]
    return [(pos, info.local_numel * size, size) for pos, info in zip(fp.param_positions, fp.layout.params)]


def _stepped_tensors(fp: FlatParamPlan) -> list[tuple[int, int, int]]:
    """``_local_params`` as one optimizer over ``module.parameters()``
    steps them: each run of parameters that lie back to back in the shard
    as one tensor, at its first parameter's place ([Note: the flat step] in
    optim/flat_step.py)."""
    enabled = flat_step_enabled()
    stepped = fp._stepped.get(enabled)
    if stepped is not None:
        return stepped
    stepped = params = _local_params(fp)
    if fp.layout is not None and len(params) == len(fp.layout.params) and enabled:
        stepped = []
        for run in flat_runs(fp.layout.params):
            pieces = [params[index] for index in run]
            stepped.append((min(position for position, _, _ in pieces), sum(n for _, n, _ in pieces), pieces[0][2]))
    fp._stepped[enabled] = stepped
    return stepped


def _single_tensor_adam_bytes(params: Sequence[tuple[int, int, int]], *, previous_alive: bool) -> int:
    """[Note: Adam's single-tensor step, planned] over ``params`` (position,
    bytes, item size), stepped in position order."""
    worst = previous = 0
    for _, nbytes, size in sorted(params):
        worst = max(worst, previous + 2 * nbytes + _WRAPPED_FLOAT_BYTES + size)
        previous = nbytes if previous_alive else 0
    return worst


def optimizer_step_bytes(flat_params: Sequence[FlatParamPlan], optimizer: str, device_type: str) -> int:
    """Temporaries of one ``optimizer.step()``: Adam's foreach path (CUDA)
    keeps ``sqrt(exp_avg_sq)`` for every parameter at once; the per-parameter
    path (CPU) two parameter-sized temporaries, the previous parameter's
    ``denom`` and two scalars ([Note: Adam's single-tensor step, planned])."""
    if optimizer not in ("adam", "adamw"):
        return 0
    trainable = [fp for fp in flat_params if fp.requires_grad]
    if device_type == "cuda":
        return sum(fp.local_numel * fp.dtype.itemsize for fp in trainable)
    return _single_tensor_adam_bytes([p for fp in trainable for p in _stepped_tensors(fp)], previous_alive=True)


def in_backward_step_bytes(flat_params: Sequence[FlatParamPlan], optimizer: str, device_type: str) -> int:
    """Temporaries of one hook's step of a per-parameter optimizer ([Note:
    optimizer in backward, planned]): Adam's single-tensor path (CPU) two
    temporaries the size of the parameter and two scalars, its foreach path
    (CUDA, over one tensor) one; the largest parameter of ``flat_params``
    decides."""
    if optimizer not in ("adam", "adamw"):
        return 0
    trainable = [fp for fp in flat_params if fp.requires_grad]
    if device_type == "cuda":
        return max((fp.max_local_numel * fp.dtype.itemsize for fp in trainable), default=0)
    return _single_tensor_adam_bytes([p for fp in trainable for p in _local_params(fp)], previous_alive=False)


def freed_allocation_sizes(flat_params: Sequence[FlatParamPlan]) -> list[int]:
    """Sizes (bytes) of the tensors a rank allocates and frees for
    ``flat_params`` over building and a step, the largest of each kind per
    flat parameter: the gathered buffer, the per-parameter gradient pieces
    (and the originals ``fully_shard`` frees), the padded flat gradient in
    the compute and reduction dtypes, the sharded gradient (freed by
    ``zero_grad``), the optimizer's temporaries, the all-gather source.
    What glibc's mmap threshold follows (planning/runtime_memory.py)."""
    sizes = []
    enabled = flat_step_enabled()
    for fp in flat_params:
        own = fp._freed.get(enabled)
        if own is None:
            largest_param = max((numel for _, numel in fp.last_uses), default=0)
            own = [fp.unsharded_bytes, fp.gather_source_bytes, largest_param * fp.dtype.itemsize]
            if fp.requires_grad:
                own += [
                    largest_param * fp.param_dtype.itemsize,
                    fp.unsharded_grad_bytes,
                    fp.padded_numel * fp.reduce_dtype.itemsize,
                    fp.grad_bytes,
                    # The optimizer's temporaries: a run's under the flat step.
                    max((nbytes for _, nbytes, _ in _stepped_tensors(fp)), default=0),
                ]
            fp._freed[enabled] = own
        sizes += own
    return sizes


def gloo_buffer_sizes(flat_params: Sequence[FlatParamPlan]) -> list[int]:
    """Sizes (bytes) of the flat copies gloo's worker threads allocate for
    ``flat_params``' collectives on CPU without shared memory: an
    all-gather's whole output and a reduction's padded gradient."""
    sizes = []
    for fp in flat_params:
        if fp.all_gather_copy_bytes:
            sizes.append(fp.all_gather_copy_bytes)
            if fp.requires_grad:
                sizes.append(fp.padded_numel * fp.reduce_dtype.itemsize)
    return sizes
