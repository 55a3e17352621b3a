"""torch's own clipping over a sharded model: ``torch.nn.utils.clip_grad_norm_
(model.parameters(), ...)`` (what most scripts call) returns the global norm,
equal on every rank, and clips every rank's shard by the same coefficient,
as a single process does on the global batch; so do
``torch.nn.utils.get_total_norm`` followed by ``clip_grads_with_norm_``, and
``clip_grad_value_`` (elementwise). FULL_SHARD and SHARD_GRAD_OP at 2 ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, plain_step, run_parity, shard_manually


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # Linear in the clipped gradients (AdamW would normalise clipping away).
    return torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)


def _clip_by_norm(model: nn.Module, norm_type: float, totals: list[torch.Tensor]) -> None:
    totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type))


def _clip_in_two_calls(model: nn.Module, norm_type: float, totals: list[torch.Tensor]) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, total)
    totals.append(total)


def _clip_by_value(model: nn.Module, norm_type: float, totals: list[torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)


CLIPPINGS = {"clip_grad_norm_": _clip_by_norm, "get_total_norm + clip_grads_with_norm_": _clip_in_two_calls, "clip_grad_value_": _clip_by_value}


def _torch_clipping_matches_reference(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        for clipping_name, clip in CLIPPINGS.items():
            for norm_type in (2.0, math.inf) if clip is _clip_by_norm else (2.0,):
                what = f"{strategy.name}, {clipping_name}, norm_type={norm_type}"
                totals: list[torch.Tensor] = []
                reference_totals: list[torch.Tensor] = []

                def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                    loss = plain_step(model, inputs, targets)
                    clip(model, norm_type, totals)
                    return loss

                def reference_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                    loss = plain_step(model, inputs, targets)
                    clip(model, norm_type, reference_totals)
                    return loss

                # Compares loss, the full clipped gradients and the parameters
                # with the single-process reference after every step.
                parity = Parity(
                    build=TinyGPT, shard=shard_manually(strategy), steps=2, step_fn=step,
                    reference_step_fn=reference_step, make_optimizer=_sgd,
                )
                try:
                    run_parity(parity)
                except AssertionError as error:
                    raise AssertionError(f"{what}: {error}") from error
                for index, (total, expected) in enumerate(zip(totals, reference_totals, strict=True)):
                    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what}, step {index}: {m}")
                    assert expected > 0.05, f"{what}: the reference did not clip"
                    gathered = [torch.empty_like(total) for _ in range(world_size)]
                    dist.all_gather(gathered, total.contiguous())
                    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: ranks disagree: {gathered}"


def test_torch_clip_grad_norm_and_value_over_model_parameters_match_reference() -> None:
    run_distributed(_torch_clipping_matches_reference, 2)

