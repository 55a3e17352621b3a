"""Owns: the per-rank memory arithmetic of a sharding plan — what one flat
parameter costs in each state, the optimizer state per kind, the worst moment
of a training step (replaying the order in which the runtime gathers, frees
and reduces), and activations measured under fake tensors.

Knows nothing of: process groups, hooks, how units are chosen (``sharding_plan.py``
gives it finished ``FlatParamPlan``/``UnitPlan`` descriptions).

Public names: ``FlatParamPlan``, ``UnitPlan``, ``StepPeak``,
``optimizer_bytes``, ``optimizer_step_bytes``, ``in_backward_step_bytes``,
``step_moments``, ``step_peak``, ``worst_moment``, ``OPTIMIZERS``,
``OPTIMIZER_STEP``, ``freed_allocation_sizes``, ``gloo_buffer_sizes``. Activations are measured in ``activations.py``.

[Note: the step the plan replays]
The plan assumes the usual loop (``zero_grad(set_to_none=True)``, forward,
backward, ``optimizer.step()``, optimizer state already there) and replays
the runtime's order; its worst moment is the plan's peak.

- Forward: units in module pre-order (taken to be registration order), each
  with its ancestors gathered; the root and the last unit stay gathered
  until their backward, ``SHARD_GRAD_OP`` units too; forward prefetch
  gathers the next unit early. On CUDA a unit's freed buffer is held until
  the next all-gather allocated its own (``holds_freed_buffer``), so an
  unprefetched next unit briefly has both.
- Backward, in reverse: the unit's and its ancestors' gathered parameters,
  the ``BACKWARD_PRE`` prefetch (on CPU it comes after the unit's reduction
  is issued, as ``BACKWARD_POST``), the unit's per-parameter and padded flat
  gradients together for a moment, ancestors' gradients autograd holds
  until their flat gradient completes, one reduction in flight
  (``Scheduler.MAX_REDUCTIONS_IN_FLIGHT``; through shared memory only its
  output), gloo's flat copy of an all-gather's output (CPU without shared
  memory), and the sharded gradients reduced so far.
- ``optimizer.step()``: every sharded gradient plus the optimizer's
  temporaries.

[Note: optimizer in backward, planned]
With ``optimizer_in_backward`` the user steps a per-parameter optimizer in
each parameter's post-accumulate-grad hook and sets its ``.grad`` to None
([Note: user post-accumulate-grad hooks] in runtime/state.py). A unit's hooks run
where its reduction finishes (the next unit's post-backward, on CPU through
gloo its pre-backward, the root's at the end of backward); then its sharded
gradient, the rest of its reduction (a padded gradient gloo still holds)
and one parameter's step temporaries are alive, and the gradient is freed
once its last parameter stepped. No sharded gradient outlives its hooks, so
the model state after a step has none (fp32 AdamW: 12 bytes a parameter,
not 16) and there is no ``optimizer.step()`` moment. With CPU offload the
hooks are deferred to the end of backward, where every gradient is alive
until its unit's hooks ran. Pinned by tests/plan/test_plan.py (the
``*_in_backward`` cases of tests/support/plan_measure.py).

The plan counts live tensors; on CPU the resident set follows them because
the backward trims the C heap ([Note: trimming the host heap in backward]
in runtime/host_memory.py). Pinned by tests/plan/test_plan.py (the plan against the
allocator's bytes and the step's profiled peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..api import BackwardPrefetch, ShardingStrategy
from ..handle.layout import FlatParamLayout

__all__ = [
    "OPTIMIZERS",
    "FlatParamPlan",
    "UnitPlan",
    "StepPeak",
    "optimizer_bytes",
    "optimizer_step_bytes",
    "in_backward_step_bytes",
    "step_moments",
    "step_peak",
    "worst_moment",
    "OPTIMIZER_STEP",
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


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

    @property
    def padding(self) -> int:
        """Alignment and tail padding elements of the unsharded buffer."""
        return self.padded_numel - self.numel

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * _itemsize(self.dtype)

    @property
    def grad_bytes(self) -> int:
        """The sharded gradient after backward: one flat tensor, or none when
        this rank holds no element of any parameter."""
        if not self.requires_grad or self.local_param_count == 0:
            return 0
        return self.shard_numel * _itemsize(self.grad_dtype)

    @property
    def unsharded_bytes(self) -> int:
        return self.padded_numel * _itemsize(self.param_dtype) if self.needs_unshard_storage else 0

    @property
    def gather_source_bytes(self) -> int:
        """A temporary copy of the shard in the compute dtype/device for the
        all-gather (mixed precision or offload)."""
        if self.param_dtype == self.dtype and not self.offload:
            return 0
        return self.shard_numel * _itemsize(self.param_dtype)

    @property
    def all_gather_copy_bytes(self) -> int:
        """gloo's own flat output of an all-gather in flight (CPU, message
        path): the padded unsharded size."""
        if not (self.all_gather_copies_output and self.is_sharded):
            return 0
        return self.padded_numel * _itemsize(self.param_dtype)

    @property
    def unsharded_grad_bytes(self) -> int:
        return self.padded_numel * _itemsize(self.param_dtype) if self.requires_grad else 0

    @property
    def grad_pieces_bytes(self) -> int:
        """Per-parameter gradients autograd holds before it concatenates them
        into the padded flat gradient."""
        return self.numel * _itemsize(self.param_dtype) if self.requires_grad else 0

    def grad_bytes_used_after(self, module_index: int) -> int:
        """Gradient pieces of parameters last registered after
        ``module_index`` (held by autograd while that module's backward
        runs)."""
        if not self.requires_grad:
            return 0
        numel = sum(n for last, n in self.last_uses if last > module_index)
        return numel * _itemsize(self.param_dtype)

    @property
    def tied_grad_bytes(self) -> int:
        """While a tied parameter's gradients are summed: one per use besides
        the piece already counted, and the sum."""
        return self.tied_use_numel * _itemsize(self.param_dtype) if self.requires_grad else 0

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
        size = _itemsize(self.reduce_dtype)
        output = self.shard_numel * size if self.is_sharded else 0
        return self.padded_numel * size + output

    @property
    def reduction_holds_grad_bytes(self) -> int:
        """The padded gradient a reduction in flight keeps (none through
        shared memory, which copied it out when issued)."""
        if not self.requires_grad or (self.reduction_frees_grad and self.is_sharded):
            return 0
        return self.padded_numel * _itemsize(self.reduce_dtype)

    @property
    def reduction_kept_at_finish_bytes(self) -> int:
        """What a finished reduction still keeps, besides the sharded
        gradient it became, while its finish (and the user's hooks) run:
        the inputs gloo held (the padded gradient in the reduce dtype and,
        cast, in the compute dtype), the output if cast to the gradient
        dtype (``comm.reduce_grad``, ``comm.finish_grad_reduction``)."""
        if not self.requires_grad:
            return 0
        reduce, compute = _itemsize(self.reduce_dtype), _itemsize(self.param_dtype)
        cast = self.padded_numel * compute if self.param_dtype != self.reduce_dtype else 0
        if not self.is_sharded:
            kept = cast
        elif self.reduction_frees_grad:
            kept = 0
        else:
            kept = self.padded_numel * reduce + cast
        if self.grad_dtype != self.reduce_dtype:
            kept += self.shard_numel * reduce
        return kept

    @property
    def reduction_bytes(self) -> int:
        """Buffers of this flat parameter's reduction while it is in flight
        (after the issue)."""
        if self.reduction_frees_grad and self.is_sharded and self.requires_grad:
            return self.shard_numel * _itemsize(self.reduce_dtype)
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
        return sum(getattr(fp, attr) for fp in self.flat_params)

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
                # so torch.optim keeps a step for each.
                kinds[kind] += _STEP_BYTES * fp.param_count
            elif kind == "momentum_buffer":
                kinds[kind] += fp.local_numel * _itemsize(fp.grad_dtype)
            else:
                kinds[kind] += fp.local_numel * _itemsize(fp.dtype)
    return kinds


def optimizer_step_bytes(flat_params: Sequence[FlatParamPlan], optimizer: str, device_type: str) -> int:
    """Temporaries of one ``optimizer.step()``: Adam's foreach path (CUDA)
    keeps ``sqrt(exp_avg_sq)`` for every parameter at once; the per-parameter
    path (CPU) two parameter-sized temporaries for the largest parameter."""
    if optimizer not in ("adam", "adamw"):
        return 0
    trainable = [fp for fp in flat_params if fp.requires_grad]
    if device_type == "cuda":
        return sum(fp.local_numel * _itemsize(fp.dtype) for fp in trainable)
    return max((2 * fp.max_local_numel * _itemsize(fp.dtype) for fp in trainable), default=0)


def in_backward_step_bytes(flat_params: Sequence[FlatParamPlan], optimizer: str, device_type: str) -> int:
    """Temporaries of one hook's step of a per-parameter optimizer ([Note:
    optimizer in backward, planned]): Adam's single-tensor path (CPU) two
    temporaries the size of the parameter, its foreach path (CUDA, over one
    tensor) one; the largest parameter of ``flat_params`` decides."""
    if optimizer not in ("adam", "adamw"):
        return 0
    largest = max((fp.max_local_numel * _itemsize(fp.dtype) for fp in flat_params if fp.requires_grad), default=0)
    return largest if device_type == "cuda" else 2 * largest


def freed_allocation_sizes(flat_params: Sequence[FlatParamPlan]) -> list[int]:
    """Sizes (bytes) of the tensors a rank allocates and frees for
    ``flat_params`` over building and a step, the largest of each kind per
    flat parameter: the gathered buffer, the per-parameter gradient pieces
    (and the originals ``fully_shard`` frees), the padded flat gradient in
    the compute and reduction dtypes, the sharded gradient (freed by
    ``zero_grad``), the optimizer's temporaries, the all-gather source.
    What glibc's mmap threshold follows (planning/runtime_memory.py)."""
    sizes = []
    for fp in flat_params:
        largest_param = max((numel for _, numel in fp.last_uses), default=0)
        sizes += [fp.unsharded_bytes, fp.gather_source_bytes, largest_param * _itemsize(fp.dtype)]
        if fp.requires_grad:
            sizes += [
                largest_param * _itemsize(fp.param_dtype),
                fp.unsharded_grad_bytes,
                fp.padded_numel * _itemsize(fp.reduce_dtype),
                fp.grad_bytes,
                fp.max_local_numel * _itemsize(fp.dtype),
            ]
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
                sizes.append(fp.padded_numel * _itemsize(fp.reduce_dtype))
    return sizes


# The label of the usual loop's optimizer step in the replay.
OPTIMIZER_STEP = "optimizer.step()"


@dataclass(frozen=True)
class StepPeak:
    """One moment of a step (the worst one, from ``step_peak``) and what is
    alive then, besides the sharded parameters and optimizer state (always
    alive)."""

    moment: str
    sharded_grads: int
    unsharded_params: int
    unsharded_grads: int
    comm: int
    optimizer_step: int
    activations: int = 0

    @property
    def transient(self) -> int:
        return (
            self.sharded_grads
            + self.unsharded_params
            + self.unsharded_grads
            + self.comm
            + self.optimizer_step
            + self.activations
        )


def step_peak(units: Sequence[UnitPlan], **kwargs: Any) -> StepPeak:
    """The worst moment of ``step_moments(units, **kwargs)``."""
    return worst_moment(step_moments(units, **kwargs))


def worst_moment(moments: Sequence[StepPeak]) -> StepPeak:
    """The moment with the most transient bytes; on a tie the optimizer
    step, else the earliest."""
    return max(moments, key=lambda m: (m.transient, m.moment == OPTIMIZER_STEP))


def step_moments(
    units: Sequence[UnitPlan],
    *,
    optimizer_step: int,
    all_grads: int,
    activations: Mapping[str, int],
    activations_at_open: Mapping[str, int] | None = None,
    holds_freed_buffer: bool = False,
    prefetch_after_reduction: bool = False,
    in_backward_steps: Sequence[int] | None = None,
    hooks_after_backward: bool = False,
) -> list[StepPeak]:
    """Replay one step over ``units`` (module pre-order, root first; see
    [Note: the step the plan replays]) and return its moments in order.
    ``activations``: measured activation bytes by moment label (``"forward
    of 'name'"``, ``"backward of 'name'"``), absent when not measured;
    ``activations_at_open``: the bytes live when each of those windows
    opened. ``holds_freed_buffer``: the lanes hold the buffer a post-forward
    freed until the next all-gather allocated its own (CUDA).
    ``prefetch_after_reduction``: ``BACKWARD_PRE`` prefetches at the
    ``BACKWARD_POST`` point, as on CPU ([Note: backward prefetch on CPU] in
    runtime/prefetch.py). ``in_backward_steps``: per unit, the temporaries of its
    hooks' optimizer steps ([Note: optimizer in backward, planned]); None for
    the usual loop. ``hooks_after_backward``: those hooks are deferred to the
    end of backward (CPU offload)."""
    opening = activations_at_open or {}
    moments: list[StepPeak] = []
    gathered: dict[int, int] = {}  # unit index -> unsharded bytes alive
    stepped_in_hooks = in_backward_steps is not None and not hooks_after_backward
    reduced = 0  # sharded gradients finished (and not yet stepped in hooks)
    in_flight = 0  # the one reduction the scheduler keeps in flight

    def gather(index: int) -> int:
        """Unshard units[index]; returns its all-gather source temporaries."""
        # gloo's copy only where an all-gather really runs (not for a unit
        # still gathered: the root, the unit kept, a prefetched one).
        copy = 0 if index in gathered else units[index].bytes_of("all_gather_copy_bytes")
        gathered[index] = units[index].bytes_of("unsharded_bytes")
        return units[index].bytes_of("gather_source_bytes") + copy

    def moment(
        label: str, grads: int, unsharded_grads: int, comm: int, window: str | None = None, acts: int | None = None
    ) -> None:
        if acts is None:
            acts = activations.get(window or label, 0)
        moments.append(StepPeak(label, grads, sum(gathered.values()), unsharded_grads, comm, 0, acts))

    def finish(index: int, unsharded_grads: int, comm: int, acts: int) -> None:
        """units[index]'s reduction finished: its sharded gradient exists
        until the end of the step, or, stepped in its hooks, until they ran
        ([Note: optimizer in backward, planned])."""
        nonlocal reduced
        grad = units[index].bytes_of("grad_bytes")
        if not stepped_in_hooks:
            reduced += grad
            return
        assert in_backward_steps is not None
        label = f"optimizer step in backward of '{units[index].name or '<root>'}'"
        kept = units[index].bytes_of("reduction_kept_at_finish_bytes")
        moments.append(
            StepPeak(label, grad, sum(gathered.values()), unsharded_grads, kept + comm, in_backward_steps[index], acts)
        )

    def reshard_finished(running: UnitPlan | None) -> list[int]:
        """Post-forward of every unit that finished: free unless the root or
        kept until backward (SHARD_GRAD_OP). Returns the freed indices."""
        freed = []
        for index in list(gathered):
            unit = units[index]
            still_running = running is not None and (unit is running or unit.is_ancestor_of(running))
            # The root and the unit that runs last stay gathered for backward
            # ([Note: the last unit stays gathered] in runtime/prefetch.py).
            kept = index in (0, len(units) - 1)
            if not kept and not still_running and unit.strategy.reshards_after_forward:
                del gathered[index]
                freed.append(index)
        return freed

    for index, unit in enumerate(units):  # forward
        freed = reshard_finished(unit)
        source = gather(index)
        name = unit.name or "<root>"
        prefetched = index > 0 and units[index - 1].forward_prefetch
        if holds_freed_buffer and freed and not prefetched:
            # The units freed since the last gather are nested: the
            # outermost ran its post-forward last, and is the one held.
            held = min(freed)
            gathered[held] = units[held].bytes_of("unsharded_bytes")
            moment(f"all-gather of '{name}'", 0, 0, source, acts=opening.get(f"forward of '{name}'", 0))
            del gathered[held]
        if unit.forward_prefetch and index + 1 < len(units):
            source += gather(index + 1)
        moment(f"forward of '{unit.name or '<root>'}'", 0, 0, source)
    reshard_finished(None)
    moment("start of backward", 0, 0, 0)

    for index in range(len(units) - 1, -1, -1):  # backward
        unit = units[index]
        prefetch = unit.backward_prefetch
        if prefetch is BackwardPrefetch.BACKWARD_PRE and prefetch_after_reduction:
            prefetch = BackwardPrefetch.BACKWARD_POST
        source = gather(index)
        # On CPU a reduction that holds its padded gradient is finished at
        # this pre-backward ([Note: backward prefetch on CPU]); an ancestor's
        # pre-backward ran before its descendants' backward, not after.
        finished_early = (
            prefetch_after_reduction
            and index + 1 < len(units)
            and not unit.is_ancestor_of(units[index + 1])
            and units[index + 1].bytes_of("reduction_holds_grad_bytes") > 0
        )
        held = sum(
            fp.grad_bytes_used_after(unit.subtree_last)
            for u in units
            if u.is_ancestor_of(unit)
            for fp in u.flat_params
        )
        name = unit.name or "<root>"
        if finished_early:
            finish(index + 1, held, source, opening.get(f"backward of '{name}'", 0))
            in_flight = 0
        if prefetch is BackwardPrefetch.BACKWARD_PRE and index > 0:
            source += gather(index - 1)
        pieces = unit.bytes_of("grad_pieces_bytes")
        # The tied sums come before the concatenation into the flat gradient.
        pieces += max(unit.bytes_of("tied_grad_bytes"), unit.bytes_of("unsharded_grad_bytes"))
        # Activations peak as the unit's backward starts; its gradient pieces
        # and the flat gradient exist at its end, when most are freed: what
        # is live then is what the next unit's backward opens with.
        closing = opening.get(f"backward of '{units[index - 1].name or '<root>'}'") if index > 0 else None
        moment(f"start of backward of '{name}'", reduced, held, in_flight + source, f"backward of '{name}'")
        moment(f"backward of '{name}'", reduced, held + pieces, in_flight + source, acts=closing)
        # Post-backward: the previous reduction finishes (its output becomes
        # a sharded gradient), this one is issued, the unit reshards.
        if index + 1 < len(units) and not finished_early:
            window = activations.get(f"backward of '{name}'", 0)
            finish(index + 1, held + unit.bytes_of("unsharded_grad_bytes"), 0, window)
        converting = unit.bytes_of("conversion_bytes")
        issuing = unit.bytes_of("reduction_issue_bytes")
        moment(f"reduce-scatter of '{name}'", reduced, held + converting, issuing, f"backward of '{name}'")
        in_flight = unit.bytes_of("reduction_bytes")
        gathered.pop(index, None)
        if prefetch is BackwardPrefetch.BACKWARD_POST and index > 0:
            source = gather(index - 1)
            # This unit's backward is over: what is live as the next opens.
            moment(f"prefetch after '{name}'", reduced, held, in_flight + source, f"backward of '{name}'", acts=closing)
    if units:  # end of backward: the root's reduction finishes
        finish(0, 0, 0, 0)
    if in_backward_steps is None:
        moments.append(StepPeak(OPTIMIZER_STEP, all_grads, 0, 0, 0, optimizer_step))
    elif hooks_after_backward:
        # Offloaded: every hook deferred to here, units in backward order.
        for index in range(len(units) - 1, -1, -1):
            label = f"optimizer step in backward of '{units[index].name or '<root>'}'"
            moments.append(StepPeak(label, reduced, 0, 0, 0, in_backward_steps[index]))
            reduced -= units[index].bytes_of("grad_bytes")
    return moments
