"""The parity helper's gradient check after adaptive steps
(tests/support/parity.py, [Note: gradients after an adaptive step]): a
gradient that differs from the reference's past the tolerance is compared
with the reference's gradient at the model's own parameters, and a wrong
gradient still fails there. (That the fallback accepts what the fixed
tolerance rejects is shown on wide layers by
tests/training/test_small_unit_groups.py's budget parity test.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, plain_step, run_parity, shard_manually

from composable_shard import ShardingStrategy


def _wrong_from_step_1(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain step, then, from the second step on, rank 0's local
    gradient of the head's first element 1e-3 off."""
    loss = plain_step(model, inputs, targets)
    steps = getattr(model, "_steps_taken", 0)
    model._steps_taken = steps + 1  # type: ignore[assignment]
    grad = model.head.weight.grad  # type: ignore[union-attr]
    if steps >= 1 and torch.distributed.get_rank() == 0 and grad is not None and grad.numel():
        grad.view(-1)[0] += 1e-3
    return loss


def _wrong_gradient_fails_against_the_reference_at_the_model(rank: int, world_size: int) -> None:
    parity = Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD), step_fn=_wrong_from_step_1)
    with pytest.raises(AssertionError, match="step 1 after backward, gradient of .* against the reference's at the model's parameters"):
        run_parity(parity)


def test_a_wrong_gradient_after_an_adaptive_step_still_fails() -> None:
    run_distributed(_wrong_gradient_fails_against_the_reference_at_the_model, 2)
