"""Owns: the worst moment of a training step — replaying, per rank, the
order in which the runtime gathers, frees and reduces (buckets of small
reductions included), from the plan's ``UnitPlan`` descriptions.

Knows nothing of: process groups, hooks, how units are chosen, what one
flat parameter costs (``memory.py``).

Public names: ``StepPeak``, ``step_moments``, ``step_peak``,
``worst_moment``, ``OPTIMIZER_STEP``, ``BucketRule``, ``buckets_in_backward``.

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

[Note: coalesced reductions, planned]
The runtime holds the gradients of small flat parameters and reduces them
in buckets ([Note: coalesced reductions] in runtime/grad_buckets.py);
``BucketRule`` is its rule on the plan's units, in backward order (a unit
is held when all its trainable flat parameters share one key; a unit with
nothing to train issues nothing). While held, a unit's padded gradient
counts as unsharded. Issuing a bucket finishes the reduction in flight,
then holds the held gradients, their casts to the reduce dtype, the
side-by-side copy and the output at once; in flight it keeps the output
(and, through gloo, the copy; on CUDA the gradients and casts the lane
reads too). Its wait drops all but the output, then its finish copies each
unit's shard out of the output before the output goes. Through shared memory there is no
side-by-side copy: a reduce-scatter's output is each unit's shard and an
all-reduce sums each gradient where it lies, divided in place, so the
finish copies only where a shard is cast to the gradient dtype. ``buckets_in_backward`` lists the
buckets; tests/runtime/test_coalesced_reductions.py checks the runtime
issues exactly these.

[Note: coalesced all-gathers, planned]
The runtime gathers small units in buckets ([Note: coalesced all-gathers]
in runtime/gather_buckets.py); the replay applies its rule where a unit is
gathered: forward in module pre-order, backward in reverse, the followers
that are not gathered join while each unit's flat parameters share one
key (``UnitPlan.gather_key``) and the bucket fits; a unit whose several
flat parameters share a key is a bucket of its own even alone. A bucket compute waits
for at once (a unit's own all-gather) is a moment of its own: every
member's buffer, the shards side by side and the gathered rows; a
prefetched one keeps the rows, the side-by-side shards (freed at the wait
on CPU, read by NCCL until then) and, through gloo, gloo's copy until the
next unit's pre-forward or pre-backward.
Through shared memory, where no shard needs a cast, the bucket has neither
(``all_gather_pieces`` reads and writes in place): only the buffers.
Forward frees only units that ran. Checked against the allocator by
tests/planning/test_plan.py and against the collectives by
tests/runtime/test_coalesced_all_gathers.py.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..api import BackwardPrefetch
from .memory import FlatParamPlan, UnitPlan

__all__ = [
    "StepPeak",
    "step_moments",
    "step_peak",
    "worst_moment",
    "OPTIMIZER_STEP",
    "BucketRule",
    "buckets_in_backward",
]

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


class BucketRule:
    """Which units' reductions share a collective, in backward order, by the
    runtime's rule ([Note: coalesced reductions] in runtime/grad_buckets.py):
    ``add`` a unit with trainable flat parameters; returns the bucket
    issued before it joins (another key, or it would overflow) and the one
    issued after (its own, once full); ``close`` the last one (the end of
    backward)."""

    def __init__(self, units: Sequence[UnitPlan], bucket_bytes: int) -> None:
        self.units, self.bucket_bytes = units, bucket_bytes
        self.held: list[int] = []
        self.key: tuple | None = None
        self.nbytes = 0
        # The held units' unsharded gradients (what the replay counts alive).
        self.held_grad_bytes = 0

    def add(self, index: int) -> tuple[list[int], list[int]]:
        unit = self.units[index]
        key = unit.bucket_key(self.bucket_bytes)
        nbytes = sum(fp.padded_numel * fp.reduce_dtype.itemsize for fp in unit.flat_params if fp.requires_grad)
        before: list[int] = []
        if self.held and (key != self.key or self.nbytes + nbytes > self.bucket_bytes):
            before = self.close()
        if key is None:
            return before, []
        self.held.append(index)
        self.key, self.nbytes = key, self.nbytes + nbytes
        self.held_grad_bytes += unit.bytes_of("unsharded_grad_bytes")
        return before, self.close() if self.nbytes >= self.bucket_bytes else []

    def close(self) -> list[int]:
        held, self.held, self.key, self.nbytes, self.held_grad_bytes = self.held, [], None, 0, 0
        return held


def buckets_in_backward(units: Sequence[UnitPlan], bucket_bytes: int) -> list[list[int]]:
    """The buckets one backward issues, each its units' indices in order."""
    rule, buckets = BucketRule(units, bucket_bytes), []
    for index in range(len(units) - 1, -1, -1):
        if any(fp.requires_grad for fp in units[index].flat_params):
            buckets += [bucket for bucket in rule.add(index) if bucket]
    return buckets + [rule.close()] if rule.held else buckets


def step_moments(
    units: Sequence[UnitPlan],
    *,
    optimizer_step: int,
    all_grads: int,
    activations: Mapping[str, int],
    activations_at_open: Mapping[str, int] | None = None,
    activation_pieces: Mapping[str, tuple[int, int]] | None = None,
    activations_at_end: int | None = None,
    activations_after_backward: int = 0,
    holds_freed_buffer: bool = False,
    prefetch_after_reduction: bool = False,
    in_backward_steps: Sequence[int] | None = None,
    hooks_after_backward: bool = False,
    bucket_bytes: int = 0,
    gather_bucket_bytes: int = 0,
) -> list[StepPeak]:
    """Replay one step over ``units`` (module pre-order, root first; see
    [Note: the step the plan replays]) and return its moments in order.
    ``activations``: measured activation bytes by moment label (``"forward
    of 'name'"``, ``"backward of 'name'"``), absent when not measured;
    ``activations_at_open``: the bytes live when each of those windows
    opened; ``activation_pieces``: per backward window, the gradient pieces
    made so far and the activations at the instant they add up to most
    ([Note: gradient pieces beside activations] in activations.py); ``activations_at_end``: as backward ended, where its final
    callbacks run (None: the last window's peak); ``activations_after_backward``:
    once it returned (the loss). ``holds_freed_buffer``: the lanes hold the buffer a post-forward
    freed until the next all-gather allocated its own (CUDA).
    ``prefetch_after_reduction``: ``BACKWARD_PRE`` prefetches at the
    ``BACKWARD_POST`` point, as on CPU ([Note: backward prefetch on CPU] in
    runtime/prefetch.py). ``in_backward_steps``: per unit, the temporaries of its
    hooks' optimizer steps ([Note: optimizer in backward, planned]); None for
    the usual loop. ``hooks_after_backward``: those hooks are deferred to the
    end of backward (CPU offload). ``bucket_bytes``: the runtime's bucket of
    small reductions ([Note: coalesced reductions, planned]; 0: none).
    ``gather_bucket_bytes``: the runtime's bucket of small all-gathers
    ([Note: coalesced all-gathers, planned]; 0: none)."""
    opening = activations_at_open or {}
    ancestors = _ancestors(units)
    moments: list[StepPeak] = []
    gathered = _Gathered()  # unit index -> unsharded bytes alive
    # Units a post-forward frees (the root and the unit that runs last stay
    # gathered for backward: [Note: the last unit stays gathered] in runtime/prefetch.py).
    frees_after_forward = [
        unit.strategy.reshards_after_forward and index not in (0, len(units) - 1) for index, unit in enumerate(units)
    ]
    stepped_in_hooks = in_backward_steps is not None and not hooks_after_backward
    reduced = 0  # sharded gradients finished (and not yet stepped in hooks)
    in_flight = 0  # the one reduction the scheduler keeps in flight
    # [Note: coalesced reductions, planned]: the units whose gradients are
    # held for one collective, their key and bytes; the units whose
    # reduction is in flight (one unit's, or an issued bucket's).
    rule = BucketRule(units, bucket_bytes)
    flying: list[int] = []
    flying_is_bucket = False

    def trainable_of(indices: list[int]) -> list[FlatParamPlan]:
        return [fp for i in indices for fp in units[i].flat_params if fp.requires_grad]

    def held_in_bucket() -> int:
        return rule.held_grad_bytes

    def names_of(indices: list[int]) -> str:
        return ", ".join(f"'{units[i].name or '<root>'}'" for i in indices)

    def flying_holds_input() -> bool:
        """Whether the reduction in flight still holds a gradient the
        backend reads (gloo), finished at the next unit's pre-backward."""
        if not flying:
            return False
        if flying_is_bucket:
            first = trainable_of(flying)[0]
            return not (first.is_sharded and first.reduction_frees_grad)
        return units[flying[0]].bytes_of("reduction_holds_grad_bytes") > 0

    def finish_flying(unsharded_grads: int, comm: int, acts: int) -> None:
        """The reduction in flight finishes: one unit's, or a bucket's (each
        unit gets a copy of its shard of the output, then finishes)."""
        nonlocal in_flight, flying, flying_is_bucket
        if flying_is_bucket:
            members = trainable_of(flying)
            if members[0].reduces_in_place:
                # Each shard is a tensor of its own, divided in place: a copy
                # only where the gradient dtype differs.
                copies = sum(
                    fp.shard_numel * fp.grad_dtype.itemsize for fp in members if fp.grad_dtype != fp.reduce_dtype
                )
            else:
                copies = sum(fp.shard_numel * fp.reduce_dtype.itemsize for fp in members)
            # The wait dropped the inputs (gloo's side-by-side copy of a
            # reduce-scatter): the output stays until every copy is made.
            output = sum(fp.shard_numel * fp.reduce_dtype.itemsize for fp in members)
            label = f"finish of the bucket of {names_of(flying)}"
            moments.append(StepPeak(label, reduced, gathered.total, unsharded_grads, comm + output + copies, 0, acts))
        for i in flying:
            finish(i, unsharded_grads, comm, acts)
        in_flight, flying, flying_is_bucket = 0, [], False

    def issue_bucket(bucket: list[int], unsharded_grads: int, acts: int) -> None:
        """``bucket`` is issued (``unsharded_grads``: besides its own): the
        reduction in flight finishes first, then the held gradients are
        cast, laid side by side and reduced in one collective
        (``comm.reduce_grads_together``)."""
        nonlocal in_flight, flying, flying_is_bucket
        held = sum(units[i].bytes_of("unsharded_grad_bytes") for i in bucket)
        finish_flying(unsharded_grads + held, 0, acts)
        members = trainable_of(bucket)
        sizes = [fp.reduce_dtype.itemsize for fp in members]
        casts = sum(fp.padded_numel * size for fp, size in zip(members, sizes) if fp.reduce_dtype != fp.param_dtype)
        sharded = members[0].is_sharded
        side_by_side = sum(fp.padded_numel * size for fp, size in zip(members, sizes))
        in_place = members[0].reduces_in_place  # nothing side by side
        output = sum(fp.shard_numel * size for fp, size in zip(members, sizes)) if sharded else 0
        label = f"reduction of the bucket of {names_of(bucket)}"
        moment(label, reduced, unsharded_grads + held + casts, (0 if in_place else side_by_side) + output, acts=acts)
        # In flight: a reduce-scatter's output (through shared memory the
        # input was copied out; gloo keeps it); an all-reduce's gradients,
        # side by side or, through shared memory, each where it lies.
        in_flight = output + (0 if sharded and in_place else side_by_side)
        flying, flying_is_bucket = bucket, True

    def gather(index: int, step: int, *, waited: bool, acts: int = 0, alive: tuple[int, int, int] = (0, 0, 0)) -> int:
        """Unshard units[index] (``step``: the phase's direction); returns
        the all-gather's temporaries still alive after its issue: all of
        them for a prefetch, none where compute waits at once (``waited``)
        for a bucket, which is its own moment, beside ``alive`` (sharded
        and unsharded gradients, communication buffers) ([Note: coalesced
        all-gathers, planned])."""
        if index not in gathered and gather_bucket_bytes > 0:
            members = bucket_from(index, step)
            fps = [fp for i in members for fp in units[i].flat_params if fp.needs_unshard_storage]
            if len(fps) > 1:
                in_place = all(fp.gathers_in_place for fp in fps)
                rows = 0 if in_place else sum(fp.padded_numel * fp.param_dtype.itemsize for fp in fps)
                side_by_side = 0 if in_place else sum(fp.shard_numel * fp.param_dtype.itemsize for fp in fps)
                copy = sum(fp.all_gather_copy_bytes for fp in fps)
                for i in members:
                    gathered[i] = units[i].bytes_of("unsharded_bytes")
                if waited:
                    label = f"all-gather of the bucket of {names_of(members)}"
                    moment(label, alive[0], alive[1], alive[2] + rows + side_by_side + copy, acts=acts)
                    return 0
                # Until its wait: the gathered rows, gloo's copy, and the
                # side-by-side shards (``comm.all_gather_together`` frees both
                # buffers at the wait on CPU; NCCL reads the shards until then).
                return rows + copy + side_by_side
        # gloo's copy only where an all-gather really runs (not for a unit
        # still gathered: the root, the unit kept, a prefetched one).
        copy = 0 if index in gathered else units[index].bytes_of("all_gather_copy_bytes")
        gathered[index] = units[index].bytes_of("unsharded_bytes")
        return units[index].bytes_of("gather_source_bytes") + copy

    def bucket_from(index: int, step: int) -> list[int]:
        """The units whose all-gathers join units[index]'s: the followers
        in the phase's order, passing over gathered ones, while each shares
        its key and the bucket fits; none where units[index] has no key
        (gathered alone)."""
        key = units[index].gather_key(gather_bucket_bytes)
        if key is None:
            return []
        members, total = [index], units[index].bytes_of("unsharded_bytes")
        follower = index + step
        while 0 <= follower < len(units):
            if follower not in gathered and units[follower].bytes_of("unsharded_bytes"):
                nbytes = units[follower].bytes_of("unsharded_bytes")
                if units[follower].gather_key(gather_bucket_bytes) != key or total + nbytes > gather_bucket_bytes:
                    break
                members.append(follower)
                total += nbytes
            follower += step
        return members

    def moment(
        label: str, grads: int, unsharded_grads: int, comm: int, window: str | None = None, acts: int | None = None
    ) -> None:
        if acts is None:
            acts = activations.get(window or label, 0)
        moments.append(StepPeak(label, grads, gathered.total, unsharded_grads, comm, 0, acts))

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
            StepPeak(label, grad, gathered.total, unsharded_grads, kept + comm, in_backward_steps[index], acts)
        )

    started: list[int] = []  # units whose forward runs (an ancestor's encloses theirs)

    def end_forwards(running: int | None, pending: int) -> list[int]:
        """The forwards that ended before units[running] starts (None: every
        one left), innermost first: each frees its parameters unless the
        root or kept until backward (SHARD_GRAD_OP, the last unit), then its
        parent's code after it runs, a window of its own ([Note: activation
        windows] in activations.py), beside ``pending`` (a prefetch still in
        flight). Units gathered ahead of their forward (a bucket's
        followers, a prefetch) have not started. Returns the freed indices."""
        freed = []
        for index in sorted((i for i in started if running is None or i not in ancestors[running]), reverse=True):
            started.remove(index)
            frees = frees_after_forward[index] and index in gathered
            # Where a free waits for the next all-gather's allocation (CUDA,
            # nothing in flight), the buffer is still there in the parent's code.
            held = frees and holds_freed_buffer and not pending
            if frees and not held:
                del gathered[index]
            if ancestors[index]:
                parent = units[max(ancestors[index])].name or "<root>"
                moment(f"forward of '{parent}' after '{units[index].name}'", 0, 0, pending)
            if held:
                del gathered[index]
            if frees:
                freed.append(index)
        return freed

    pending = 0  # a forward prefetch's temporaries, alive until the next unit's wait
    for index, unit in enumerate(units):  # forward
        freed = end_forwards(index, pending)
        started.append(index)
        name = unit.name or "<root>"
        source = gather(index, +1, waited=True, acts=opening.get(f"forward of '{name}'", 0))
        prefetched = index > 0 and units[index - 1].forward_prefetch
        if holds_freed_buffer and freed and not prefetched:
            # The units freed since the last gather are nested: the
            # outermost ran its post-forward last, and is the one held.
            held = min(freed)
            gathered[held] = units[held].bytes_of("unsharded_bytes")
            moment(f"all-gather of '{name}'", 0, 0, source, acts=opening.get(f"forward of '{name}'", 0))
            del gathered[held]
        pending = gather(index + 1, +1, waited=False) if unit.forward_prefetch and index + 1 < len(units) else 0
        moment(f"forward of '{unit.name or '<root>'}'", 0, 0, source + pending)
    end_forwards(None, pending)
    moment("start of backward", 0, 0, 0)

    for index in range(len(units) - 1, -1, -1):  # backward
        unit = units[index]
        prefetch = unit.backward_prefetch
        if prefetch is BackwardPrefetch.BACKWARD_PRE and prefetch_after_reduction:
            prefetch = BackwardPrefetch.BACKWARD_POST
        name = unit.name or "<root>"
        held = sum(
            fp.grad_bytes_used_after(unit.subtree_last) for i in ancestors[index] for fp in units[i].flat_params
        )
        alive = (reduced, held + held_in_bucket(), in_flight)
        source = gather(index, -1, waited=True, acts=opening.get(f"backward of '{name}'", 0), alive=alive)
        # On CPU a reduction that holds its padded gradient is finished at
        # this pre-backward ([Note: backward prefetch on CPU]); an ancestor's
        # pre-backward ran before its descendants' backward, not after.
        finished_early = (
            prefetch_after_reduction
            and flying_holds_input()
            and not any(index in ancestors[i] for i in flying)
        )
        if finished_early:
            finish_flying(held + held_in_bucket(), source, opening.get(f"backward of '{name}'", 0))
        if prefetch is BackwardPrefetch.BACKWARD_PRE and index > 0:
            source += gather(index - 1, -1, waited=False)
        pieces = unit.bytes_of("grad_pieces_bytes")
        # The tied sums come before the concatenation into the flat gradient.
        pieces += max(unit.bytes_of("tied_grad_bytes"), unit.bytes_of("unsharded_grad_bytes"))
        # Activations peak as the unit's backward starts; its gradient pieces
        # and the flat gradient exist at its end, when most are freed: what
        # is live then is what the next unit's backward opens with.
        # The first unit's backward (the root's) closes as backward ends.
        closing = opening.get(f"backward of '{units[index - 1].name or '<root>'}'") if index > 0 else activations_at_end
        window = f"backward of '{name}'"
        moment(f"start of backward of '{name}'", reduced, held + held_in_bucket(), in_flight + source, window)
        made, acts_then = (activation_pieces or {}).get(window, (0, 0))
        if made:
            moment(f"gradient pieces of '{name}'", reduced, held + held_in_bucket() + made, in_flight + source, acts=acts_then)
        moment(f"backward of '{name}'", reduced, held + held_in_bucket() + pieces, in_flight + source, acts=closing)
        # Its post-backward runs there too: what is live as the next opens.
        closed = closing if closing is not None else activations.get(window, 0)
        # Post-backward: the unit's gradient is held for a bucket, which is
        # issued first where it cannot join ([Note: coalesced reductions,
        # planned]); or the reduction in flight finishes (its output becomes
        # a sharded gradient) and this one is issued. Then the unit reshards.
        # A unit with nothing to train issues no reduction: a bucket stays held.
        own = unit.bytes_of("unsharded_grad_bytes")
        before, after = rule.add(index) if own else ([], [])
        if before:
            # Its own gradient is counted once: in the new bucket when it joined it.
            joined = bool(rule.held) and rule.held[-1] == index
            issue_bucket(before, held + held_in_bucket() + (0 if joined else own), closed)
        if after:
            issue_bucket(after, held + held_in_bucket(), closed)
        if rule.held and rule.held[-1] == index:
            moment(f"gradient of '{name}' held for a bucket", reduced, held + held_in_bucket(), in_flight, acts=closed)
        elif not after:
            if flying and not finished_early:
                finish_flying(held + held_in_bucket() + own, 0, closed)
            converting = unit.bytes_of("conversion_bytes")
            issuing = unit.bytes_of("reduction_issue_bytes")
            moment(f"reduce-scatter of '{name}'", reduced, held + converting, issuing, acts=closed)
            in_flight, flying, flying_is_bucket = unit.bytes_of("reduction_bytes"), [index], False
        gathered.pop(index, None)
        if prefetch is BackwardPrefetch.BACKWARD_POST and index > 0:
            source = gather(index - 1, -1, waited=False)
            # This unit's backward is over: what is live as the next opens.
            moment(f"prefetch after '{name}'", reduced, held + held_in_bucket(), in_flight + source, window, acts=closing)
    # End of backward, in its final callback: the held bucket is issued,
    # then the reduction in flight (the root's, or the last bucket's) waited on.
    end = activations_at_end or 0
    if rule.held:
        issue_bucket(rule.close(), 0, end)
    finish_flying(0, 0, end)
    if in_backward_steps is None:
        moments.append(StepPeak(OPTIMIZER_STEP, all_grads, 0, 0, 0, optimizer_step, activations_after_backward))
    elif hooks_after_backward:
        # Offloaded: every hook deferred to here, units in backward order.
        for index in range(len(units) - 1, -1, -1):
            label = f"optimizer step in backward of '{units[index].name or '<root>'}'"
            moments.append(StepPeak(label, reduced, 0, 0, 0, in_backward_steps[index], end))
            reduced -= units[index].bytes_of("grad_bytes")
    return moments


class _Gathered(dict[int, int]):
    """Unit index -> its unsharded bytes alive, and their sum (``total``),
    kept as entries come and go: every moment reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, index: int, nbytes: int) -> None:
        self.total += nbytes - self.get(index, 0)
        super().__setitem__(index, nbytes)

    def __delitem__(self, index: int) -> None:
        self.total -= self[index]
        super().__delitem__(index)

    def pop(self, index: int, default: Any = None) -> Any:
        if index not in self:
            return default
        nbytes = self[index]
        del self[index]
        return nbytes


def _ancestors(units: Sequence[UnitPlan]) -> list[set[int]]:
    """The indices of each unit's ancestors (``UnitPlan.is_ancestor_of``),
    found by name: the root and the units named by a prefix of the name up
    to a dot. A budget's search replays thousands of plans, so not by
    asking every pair."""
    index_of = {unit.name: index for index, unit in enumerate(units)}
    if len(index_of) != len(units):  # a repeated name: ask every pair
        return [{i for i, other in enumerate(units) if other.is_ancestor_of(unit)} for unit in units]
    found = []
    for index, unit in enumerate(units):
        prefixes = [unit.name[:at] for at, char in enumerate(unit.name) if char == "."]
        names = [""] + prefixes if unit.name else prefixes
        found.append({index_of[name] for name in names if index_of.get(name, index) != index})
    return found
