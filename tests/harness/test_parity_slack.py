"""The parity helper's bound after adaptive steps (tests/support/parity.py,
[Note: parity after an adaptive step]): AdamW (and RMSprop, Adagrad) turn a round-off difference
in a near-zero gradient into a sizeable part of a step, which a fixed
tolerance rejects and the bound accepts; the bound stays far below the
tolerance on ordinary elements, so a wrong step there or a wrong
learning rate is still caught. One process, no sharding: the
helper alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.support.parity import StepSlack

ATOL, RTOL = 2e-6, 1e-5


def _pair(near_zero: float) -> tuple[nn.Linear, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    reference = nn.Linear(8, 4, bias=False)
    model = copy.deepcopy(reference)
    grad = torch.randn(4, 8) * 1e-2
    grad[1, 3] = near_zero  # a gradient within round-off of zero
    return model, reference, grad


def _step(model: nn.Module, reference: nn.Module, grad: torch.Tensor, roundoff: torch.Tensor, slack: StepSlack,
          optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer]) -> None:
    reference.weight.grad = grad.clone()
    model.weight.grad = grad + roundoff
    slack.record_grad("weight", model.weight.grad, reference.weight.grad)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    slack.account_steps(reference, optimizers[1])


# Per optimizer: the largest bound an ordinary element may get after three
# steps. RMSprop's first step is lr * sign(g) / sqrt(1 - alpha), 10 lr,
# which the first-order bound does not see cancel: looser there, still far
# under the tolerance.
# Centered RMSprop with momentum: its step divides by the spread of the
# gradients, which a first-order bound sees move more.
OPTIMIZERS = {
    "AdamW": (lambda p: torch.optim.AdamW(p, lr=1e-2), ATOL / 10),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=1e-2), ATOL / 2),
    "RMSprop centered momentum": (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True), ATOL / 2),
    "Adagrad": (lambda p: torch.optim.Adagrad(p, lr=1e-2), ATOL / 10),
}


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_round_off_in_a_near_zero_gradient_is_allowed_after_an_adaptive_step(optimizer_name: str) -> None:
    make, ordinary_bound = OPTIMIZERS[optimizer_name]
    model, reference, grad = _pair(3e-9)
    optimizers = (make(model.parameters()), make(reference.parameters()))
    slack = StepSlack()
    roundoff = torch.zeros_like(grad)
    roundoff[1, 3] = 1e-9  # what another summation order leaves
    roundoff[0, 0] = grad[0, 0] * 1e-7
    for _ in range(3):
        _step(model, reference, grad, roundoff, slack, optimizers)
        # A fixed tolerance rejects the amplified element...
        with pytest.raises(AssertionError, match="Mismatched elements: 1 / 32"):
            torch.testing.assert_close(model.weight, reference.weight, atol=ATOL, rtol=RTOL)
        # ...the bound takes it, and only it is loosened.
        slack.assert_param_close("weight", model.weight, reference.weight, atol=ATOL, rtol=RTOL, when="after step")
        bound = slack.bounds["weight"]
        assert bound[1, 3] > (model.weight - reference.weight).abs()[1, 3]
        others = torch.ones_like(bound, dtype=torch.bool)
        others[1, 3] = False
        assert bound[others].max() < ordinary_bound, bound[others].max()


def test_wrong_steps_are_still_caught() -> None:
    # (A wrong gradient is compare_full's gradient check's to catch, before
    # the step: AdamW's first step is nearly sign(g) and would hide it.)
    for wrong in ("learning rate", "ordinary element"):
        model, reference, grad = _pair(3e-9)
        lr = 1.001e-2 if wrong == "learning rate" else 1e-2
        optimizers = (torch.optim.AdamW(model.parameters(), lr=lr), torch.optim.AdamW(reference.parameters(), lr=1e-2))
        slack = StepSlack()
        roundoff = torch.zeros_like(grad)
        roundoff[1, 3] = 1e-9
        _step(model, reference, grad, roundoff, slack, optimizers)
        if wrong == "ordinary element":
            with torch.no_grad():
                model.weight[2, 5] += 2e-5  # a step off by 2e-5 (2e-3 lr) where nothing amplifies
        with pytest.raises(AssertionError, match="parameter weight"):
            slack.assert_param_close("weight", model.weight, reference.weight, atol=ATOL, rtol=RTOL, when=wrong)
