"""Owns: which of a flat parameter's parameters a backward reached — read
off the split that cuts its forward views — and the warning for a trainable
parameter that a synchronised backward left without a gradient.

Knows nothing of: collectives, hooks other than the split's, training
state (the runtime says when a gradient is reduced).

Public names: ``GradUsage``.

[Note: parameters a backward leaves without a gradient]
In one process, a parameter that no path from the loss reaches keeps
``.grad`` None, and torch's optimizers skip it: no momentum, no weight
decay, no step count. DDP (``find_unused_parameters=True``) and FSDP2
leave it None too. Here the parameters of a unit share one flat gradient,
so one that took no part in a backward whose unit did receives zeros in
its range, as FSDP1 gives it, and an optimizer with momentum or weight
decay still moves it: a silent difference from the single process (an
unused pooler in the root's unit decays under AdamW; a block skipped by
stochastic depth inside a larger unit keeps moving with Adam's momentum).
Whether that parameter was reached is known locally: the forward views
are the outputs of one ``split_with_sizes`` of the unsharded flat
parameter, and autograd hands that split's backward node None for every
output no gradient reached. A pre-hook on the node (one per flat parameter
and forward, not one per parameter) records which were reached; the
records of the backwards whose gradients one reduction carries
(``no_sync`` accumulates several) are combined, and the reduction warns,
once per flat parameter, naming the parameters no backward reached on this
rank. Only the backwards before a flat parameter's first ``WATCH_FIRST``
reductions, then before one in ``WATCH_EVERY``, are watched (the hooks'
cost, below). Making them None exactly needs every rank's record (another rank may
have used the parameter: its mean gradient is then real), one more
collective per step; that is not built, so the warning says what to do: a
module whose parameters may go unused is best a unit of its own (a unit
that takes no part in a backward reduces nothing and keeps ``.grad``
None on every rank). Not recorded while dynamo traces. Pinned by
tests/runtime/test_unused_params.py.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .layout import ParamInfo

__all__ = ["GradUsage"]


class GradUsage:
    """What the backwards since the last reduction reached of one flat
    parameter's trainable parameters."""

    # The reductions watched first, then one in ``WATCH_EVERY``: a watch
    # costs a hook per split and forward and a call per backward, about 8 ms
    # a step for the bench's 65 small units measured in place, so steady
    # training pays it rarely (a parameter that goes unused one step in k is
    # named after about k * WATCH_EVERY steps).
    WATCH_FIRST = 3
    WATCH_EVERY = 50

    __slots__ = ("reached", "watched", "warned", "armed", "reductions", "_segments")

    def __init__(self) -> None:
        # Per parameter (layout order): whether a gradient reached it.
        self.reached: list[bool] = []
        # Whether a split was watched since the last reduction.
        self.watched = False
        # Warned already (once per flat parameter).
        self.warned = False
        # Whether the backwards up to the next reduction are watched, and
        # how many reductions were checked.
        self.armed = True
        self.reductions = 0
        # Each parameter's output of the split (the view plan's tuple). Only
        # plain values: the split's node holds this object through its hook,
        # and a node is no object the garbage collector sees, so a path from
        # here back to the modules would keep the model alive
        # ([Note: hooks on tensors hold the unit weakly] in runtime/hooks.py).
        self._segments: tuple[int, ...] = ()

    def watch(self, segments: Sequence[torch.Tensor], param_segments: tuple[int, ...]) -> None:
        """Record what reaches the split whose outputs are ``segments``
        (``param_segments``: each parameter's output, in layout order)."""
        # Not while dynamo traces: the grad_fn read would break the graph.
        if not self.armed or self.warned or not segments or torch.compiler.is_compiling():
            return
        node = segments[0].grad_fn
        if node is None:
            return
        if param_segments is not self._segments or not self.watched:
            self._segments = param_segments
            self.reached = [False] * len(param_segments)
        self.watched = True
        node.register_prehook(self._record)

    def _record(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        reached = self.reached
        for i, index in enumerate(self._segments):
            if not reached[i] and grad_outputs[index] is not None:
                reached[i] = True

    def check_reduced(self, params: Sequence[ParamInfo], requires_grad: Sequence[bool], unit: str) -> None:
        """A reduction carries the watched backwards' gradients: warn (once)
        for the trainable parameters (``params``: the layout's) none of
        them reached, then start over."""
        self.reductions += 1
        self.armed = self.reductions < self.WATCH_FIRST or self.reductions % self.WATCH_EVERY == 0
        if not self.watched:
            return
        self.watched = False
        unreached = [
            info.fqn for info, reached, trainable in zip(params, self.reached, requires_grad) if trainable and not reached
        ]
        if not unreached or len(unreached) == sum(requires_grad):
            return  # all reached; or none (the flat parameter's own gradient came from elsewhere)
        self.warned = True
        shown = ", ".join(unreached[:5]) + (f" and {len(unreached) - 5} more" if len(unreached) > 5 else "")
        warnings.warn(
            f"composable_shard: unit '{unit}': no backward since its last gradient reduction reached {shown} on "
            "this rank, while the unit's other parameters got gradients. Where no rank reaches them they get zero "
            "gradients (as in FSDP1), not None (one process, DDP, FSDP2), so an optimizer with momentum or weight "
            "decay still moves them. If they can go unused, give their module a fully_shard call of its own: a unit "
            "that takes no part in a backward keeps .grad None. (Warned once per flat parameter.)",
            stacklevel=2,
        )
