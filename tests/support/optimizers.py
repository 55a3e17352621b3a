"""Owns: optimizers the tests write themselves to exercise whole-parameter
stepping — an fp32 Newton-Schulz (Muon-like) optimizer, a row-normalised and
a tensor-normalised SGD — and a recorder of what an optimizer's step saw.

Knows nothing of: composable_shard (they are plain ``torch.optim``
optimizers; a sharded model's runtime decides what they see).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def newton_schulz_fp32(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonal factor of ``matrix`` (2-D) by the quintic Newton-Schulz
    iteration, all in fp32 (torch's Muon runs it in bf16)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix / (matrix.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class NewtonSchulzSGD(torch.optim.Optimizer):
    """Momentum SGD whose update of each 2-D parameter is the orthogonal
    factor of its momentum (fp32); other parameters take plain momentum."""

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                buffer = state.setdefault("momentum_buffer", torch.zeros_like(param))
                buffer.mul_(group["momentum"]).add_(param.grad)
                update = newton_schulz_fp32(buffer) if param.ndim == 2 else buffer
                param.add_(update, alpha=-group["lr"])


class RowNormalizedSGD(torch.optim.Optimizer):
    """SGD whose step divides each row of a matrix's gradient by that row's
    norm (a vector's by its norm)."""

    def __init__(self, params: Iterable, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.reshape(param.shape[0], -1) if param.ndim >= 2 else param.grad.reshape(1, -1)
                update = grad / (grad.norm(dim=1, keepdim=True) + 1e-8)
                param.add_(update.reshape(param.shape), alpha=-group["lr"])


class TensorNormalizedSGD(torch.optim.Optimizer):
    """SGD whose step is the gradient divided by its (whole tensor's) norm."""

    def __init__(self, params: Iterable, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / (param.grad.norm() + 1e-8), alpha=-group["lr"])


class StepRecorder:
    """Wraps an optimizer's step to record, per step, the shape of every
    parameter that had a gradient (what the update rule saw)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self._names = names
        optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.seen.append((self._names[id(param)], tuple(param.shape)))
