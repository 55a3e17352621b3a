"""Owns: measuring activation memory for a plan — one forward and backward of
the unsharded model under ``FakeTensorMode`` (shapes and dtypes only, no
memory), with the live bytes recorded per unit window.

Knows nothing of: sharding, layouts, process groups.

Public names: ``ActivationProfile``, ``measure_activations``.

[Note: activation windows]
Hooks on the unit modules name the window each allocation falls in, with the
labels the plan's step replay uses: ``forward of 'u'`` from ``u``'s forward
pre-hook, ``forward of 'p' after 'u'`` for its parent unit's code after
``u``'s forward (the parent's next child, or its own end: a window of its
own, as the parent's gathered parameters differ there), and
``backward of 'u'`` from the moment a gradient reaches ``u``'s outputs (back
to the parent's label once the gradient reaches ``u``'s inputs); backward
opens with ``start of backward`` (the loss and the root's last layers), so
``backward of '<root>'`` is the tail after every other unit; what is live
as backward ends (its last op: the loss and the seed gradient autograd
holds, little else) is ``at_end``. As in the usual loop (``loss =
loss_fn(model(x))``), the model's output is not kept past the loss: what
backward needs of it, the graph saved. Parameters,
buffers, inputs and parameter gradients are excluded (the plan counts those
as sharded or unsharded parameters and gradients); a storage created in
backward with a trainable parameter's shape is a parameter gradient piece.

[Note: gradient pieces beside activations]
At run time a unit's gradient pieces (one per parameter view) live until
its flat gradient is made from them, at the end of its backward, while its
activations are freed as the backward goes: the two can peak together in
the middle (a bias gradient's sum after a weight's piece exists). So each
backward window also records the pieces made in it so far at the instant
where pieces and activations add up to most (``pieces_at_peak``), which
the replay's start of that unit's backward counts.
Pinned by tests/plan/test_plan.py (test_plan_measures_activations_under_fake_tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ActivationProfile", "measure_activations"]


@dataclass(frozen=True)
class ActivationProfile:
    """Peak activation bytes over the step and per window label, the bytes
    live when each window opened and when backward ended, and the largest
    single storage."""

    peak: int
    by_window: dict[str, int]
    at_open: dict[str, int] = field(default_factory=dict)
    # Live as the backward's last op ran (the last window's close), and
    # once it returned (the loss, kept by the loop through the step).
    at_end: int = 0
    after_backward: int = 0
    # The largest single activation storage of the step (glibc's mmap
    # threshold follows the largest freed allocation: planning/runtime_memory.py).
    largest: int = 0
    # Per backward window: the gradient pieces (storages of a trainable
    # parameter's shape) made in it so far, at the instant where they and
    # the activations together peak (see [Note: gradient pieces beside
    # activations]), and the activations then.
    pieces_at_peak: dict[str, tuple[int, int]] = field(default_factory=dict)


class _Timeline(TorchDispatchMode):
    """Records when each storage an op creates appears and dies, and in
    which window."""

    def __init__(self, excluded: set[StorageWeakRef], grad_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.excluded = excluded
        self.grad_shapes = grad_shapes
        self.window = ""
        self.in_backward = False
        self.live: dict[StorageWeakRef, int] = {}
        # (window, storage, +bytes on creation / -bytes on death; None for a
        # gradient piece: its bytes, made and never freed here)
        self.events: list[tuple[str, StorageWeakRef | None, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            ref = StorageWeakRef(value.untyped_storage())
            if ref in self.excluded or ref in self.live:
                continue
            if self.in_backward and tuple(value.shape) in self.grad_shapes:
                self.excluded.add(ref)
                self.events.append((self.window, None, value.untyped_storage().nbytes()))
                continue
            self.live[ref] = value.untyped_storage().nbytes()
            self.events.append((self.window, ref, self.live[ref]))
        for ref in [ref for ref in self.live if ref.expired()]:
            self.events.append((self.window, ref, -self.live.pop(ref)))
        return out

    def live_bytes(self, ignored: set[StorageWeakRef]) -> int:
        """Bytes of the recorded storages still alive now."""
        return sum(nbytes for ref, nbytes in self.live.items() if ref not in ignored and not ref.expired())

    def profile(self, ignored: set[StorageWeakRef], after_backward: int) -> ActivationProfile:
        current = peak = largest = 0
        by_window: dict[str, int] = {}
        at_open: dict[str, int] = {}
        pieces: dict[str, int] = {}  # per window, the gradient pieces made in it so far
        pieces_at_peak: dict[str, tuple[int, int]] = {}
        for window, ref, delta in self.events:
            if ref is None or ref in ignored:
                # A piece, or a parameter's gradient made in another shape
                # (a bias's sum before its view): gradient bytes, not activations.
                if delta <= 0:
                    continue
                pieces[window] = pieces.get(window, 0) + delta
            else:
                at_open.setdefault(window, current)
                current += delta
                peak = max(peak, current)
                largest = max(largest, delta)
                by_window[window] = max(by_window.get(window, 0), current)
            made = pieces.get(window, 0)
            if made and made + current > sum(pieces_at_peak.get(window, (0, 0))):
                pieces_at_peak[window] = (made, current)
        return ActivationProfile(
            peak, by_window, at_open, at_end=current, after_backward=after_backward, largest=largest,
            pieces_at_peak=pieces_at_peak,
        )


def measure_activations(
    module: nn.Module,
    args: tuple[Any, ...],
    unit_names: dict[int, str],
    *,
    compute_dtype: torch.dtype | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: torch.device | None = None,
) -> ActivationProfile:
    """Run ``module(*args)``, the loss and its backward on fake tensors and
    return the live activation bytes by window (see [Note: activation
    windows]). ``unit_names``: id of each unit module -> its name (``""``
    for the root). ``device``: where the fake tensors live instead of the
    meta device (a model on ``meta`` planned for the CPU): kernels choose
    by device, and on ``meta`` scaled-dot-product attention takes the math
    path, which keeps every attention matrix (the 7.4M bench GPT measured
    83 MiB against 66 MiB live on the CPU, where it takes the flash
    kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        # Fresh fake tensors of the same shapes, never ``from_tensor``: the
        # converter would keep weak references to the user's parameters, and
        # a parameter with a weak reference cannot be materialised in place
        # by fully_shard later (``torch.utils.swap_tensors`` refuses).
        params = {}
        for name, param in module.named_parameters():
            dtype = compute_dtype if compute_dtype is not None and param.is_floating_point() else param.dtype
            params[name] = _fake_like(param, dtype, device).requires_grad_(param.requires_grad)
        buffers = {name: _fake_like(b, b.dtype, device) for name, b in module.named_buffers()}
        fake_args = tree_map(lambda t: _fake_like(t, t.dtype, device) if isinstance(t, torch.Tensor) else t, args)
        inputs = [t for t in tree_flatten(fake_args)[0] if isinstance(t, torch.Tensor)]
        excluded = {StorageWeakRef(t.untyped_storage()) for t in [*params.values(), *buffers.values(), *inputs]}
        trainable = [p for p in params.values() if p.requires_grad]
        grad_shapes = {tuple(p.shape) for p in trainable}
        timeline = _Timeline(excluded, grad_shapes)
        hooks = _window_hooks(module, unit_names, timeline)
        param_grads: tuple[torch.Tensor | None, ...] = ()
        try:
            with timeline:
                timeline.window = "forward of '<root>'"
                output = torch.func.functional_call(module, {**params, **buffers}, fake_args)
                loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
                del output  # not kept past the loss (see [Note: activation windows])
                timeline.in_backward = True
                timeline.window = "start of backward"
                if loss.requires_grad and trainable:
                    param_grads = torch.autograd.grad(loss, trainable, allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
        ignored = {StorageWeakRef(g.untyped_storage()) for g in param_grads if g is not None}
        return timeline.profile(ignored, after_backward=timeline.live_bytes(ignored))


def _window_hooks(module: nn.Module, unit_names: dict[int, str], timeline: _Timeline) -> list[Any]:
    """Forward hooks that set the timeline's window label for every unit."""
    hooks = []
    names = sorted(unit_names.values(), key=len)

    def parent_of(name: str) -> str:
        parents = [n for n in names if n != name and (n == "" or name.startswith(n + "."))]
        return max(parents, key=len, default="")

    def label(kind: str, name: str) -> str:
        return f"{kind} of '{name or '<root>'}'"

    def set_window(window: str, only_from: str | None = None) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            # A tensor that is one unit's output and the next unit's input:
            # the producing unit's backward starts, it wins.
            if only_from is None or timeline.window == only_from:
                timeline.window = window

        return hook

    def pre_forward(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, inputs: Any) -> None:
            timeline.window = label("forward", name)
            for tensor in tree_flatten(inputs)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(set_window(label("backward", parent_of(name)), label("backward", name)))

        return hook

    def post_forward(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, inputs: Any, output: Any) -> None:
            timeline.window = f"{label('forward', parent_of(name))} after '{name}'"
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(set_window(label("backward", name)))

        return hook

    for submodule in module.modules():
        name = unit_names.get(id(submodule))
        if name is None or submodule is module:
            continue
        hooks.append(submodule.register_forward_pre_hook(pre_forward(name)))
        hooks.append(submodule.register_forward_hook(post_forward(name)))
    return hooks


def _fake_like(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A new tensor (fake under the active mode) with ``tensor``'s shape and
    device (``device`` instead of ``meta`` when given), holding no
    reference to it."""
    where = device if device is not None and tensor.device.type == "meta" else tensor.device
    return torch.empty(tuple(tensor.shape), dtype=dtype, device=where)


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("plan: the model's output has no floating-point tensor; pass loss_fn= to measure activations.")
    loss = tensors[0].float().sum()
    for tensor in tensors[1:]:
        loss = loss + tensor.float().sum()
    return loss
