"""An exception in forward or backward, caught by the training loop (every
rank failing the same way), costs only the failed step: after
``zero_grad()`` the next steps match a single process that skipped that
batch, and the entry points between steps (state dicts, ``unshard_params``,
``clip_grad_norm_``, the optimizer) work at once. Inference-mode and
``no_grad`` forwards before, between and after training steps change
nothing."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, clip_grad_norm_, no_sync
from composable_shard.runtime.state import TrainingState, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, shard_manually

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


class StepFailure(Exception):
    """What the injected failures raise."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise StepFailure("custom Function backward")


class FaultyBlock(Block):
    """A block that can raise in its forward, or make backward raise when
    it reaches the block's output (after the units behind it reduced)."""

    fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise StepFailure("forward")
        out = super().forward(x)
        if self.fail == "backward_function":
            out = _RaiseInBackward.apply(out)
        elif self.fail == "backward_hook":
            out.register_hook(_raise_from_hook)
        return out


def _raise_from_hook(grad: torch.Tensor) -> None:
    raise StepFailure("tensor hook")


def _build() -> nn.Module:
    model = TinyGPT()
    model.blocks[1] = FaultyBlock()
    return model


def _local(rank: int, world_size: int) -> slice:
    return slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)


def _step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    lm_loss(model(inputs), targets).backward()


def _train_through_failures(
    strategy: ShardingStrategy, failure: str, rank: int, world_size: int, *, micro_batches: int = 1
) -> None:
    """Steps 0..3; step 1 fails (``failure`` in block 1) and is skipped by
    the reference. Between the failure and the next forward: zero_grad,
    then the full parameters are compared (``unshard_params`` passes the
    gate). With ``micro_batches`` > 1, the failure comes in the last
    micro-batch of step 1 after others accumulated under no_sync."""
    torch.manual_seed(0)
    model = _build()
    reference = copy.deepcopy(model)
    shard_manually(strategy)(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    parity = Parity(build=_build, shard=shard_manually(strategy), atol=5e-6, reference_optimizer=reference_optimizer)
    local = _local(rank, world_size)
    label = f"{strategy.name} {failure}"
    for step in range(4):
        inputs, targets = batch(step)
        if step == 1:
            for micro in range(micro_batches - 1):
                with no_sync(model):
                    _step(model, *batch(100 + micro))  # accumulated, then dropped with the failed step
            model.blocks[1].fail = failure
            with pytest.raises(StepFailure):
                _step(model, inputs[local], targets[local])
            model.blocks[1].fail = None
            optimizer.zero_grad()
            compare_full(model, reference, parity, f"{label}: after the failed step", grads=False)
            assert_resharded(model)
            assert all(state.training_state is TrainingState.IDLE for _, state in unit_states_under(model))
            continue
        _step(reference, inputs, targets)
        _step(model, inputs[local], targets[local])
        compare_full(model, reference, parity, f"{label} step {step}", grads=True)
        norm = clip_grad_norm_(model, 1.0)
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch.testing.assert_close(norm, reference_norm, atol=1e-5, rtol=1e-5)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"{label} step {step} after optimizer step", grads=False)


def _failures_cost_only_the_failed_step(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        for failure in ("forward", "backward_function", "backward_hook"):
            _train_through_failures(strategy, failure, rank, world_size)
    _train_through_failures(ShardingStrategy.FULL_SHARD, "backward_function", rank, world_size, micro_batches=3)


def test_a_caught_exception_in_forward_or_backward_costs_only_that_step() -> None:
    run_distributed(_failures_cost_only_the_failed_step, 2)


def _state_dict_and_optimizer_right_after_a_failed_backward(rank: int, world_size: int) -> None:
    """No forward between the failure and the other entry points."""
    torch.manual_seed(0)
    model = _build()
    reference = copy.deepcopy(model)
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    inputs, targets = batch(0)
    model.blocks[1].fail = "backward_function"
    with pytest.raises(StepFailure):
        _step(model, inputs[_local(rank, world_size)], targets[_local(rank, world_size)])
    model.blocks[1].fail = None
    full = model.state_dict()  # a collective through the gate
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, msg=lambda m: f"{name}: {m}")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    optimizer.step()  # no gradients: nothing changes
    compare_full(model, reference, Parity(build=_build, shard=lambda m: None), "after the step", grads=False)


def test_state_dict_and_optimizer_work_right_after_a_failed_backward() -> None:
    run_distributed(_state_dict_and_optimizer_right_after_a_failed_backward, 2)


# ------------------------------------------------------------- inference mode
def _eval_forward(mode: Callable[[], contextlib.AbstractContextManager]) -> Callable[[nn.Module, torch.Tensor], None]:
    def forward(model: nn.Module, inputs: torch.Tensor) -> None:
        with mode():
            model(inputs)

    return forward


def _inference_forwards_change_nothing(rank: int, world_size: int) -> None:
    local = _local(rank, world_size)
    for strategy in STRATEGIES:
        for mode in (torch.inference_mode, torch.no_grad):
            label = f"{strategy.name} {mode.__name__}"
            # A new group, so the first collective of its transport (which
            # maps and caches shared memory) runs under ``mode``.
            shard = shard_manually(strategy, process_group=dist.new_group(list(range(world_size))))
            torch.manual_seed(0)
            model = TinyGPT()
            reference = copy.deepcopy(model)
            shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            evaluate = _eval_forward(mode)
            parity = Parity(build=TinyGPT, shard=shard, atol=5e-6, reference_optimizer=reference_optimizer)
            evaluate(model, batch(50)[0][local])  # a sanity check before the first step
            for step in range(2):
                inputs, targets = batch(step)
                _step(reference, inputs, targets)
                _step(model, inputs[local], targets[local])
                evaluate(model, batch(60 + step)[0][local])  # between backward and step
                compare_full(model, reference, parity, f"{label} step {step}", grads=True)
                optimizer.step()
                reference_optimizer.step()
                optimizer.zero_grad()
                reference_optimizer.zero_grad()
                evaluate(model, batch(70 + step)[0][local])  # between steps
                assert_resharded(model)
            with torch.inference_mode():
                inputs = batch(80)[0]
                torch.testing.assert_close(model(inputs[local]), reference(inputs)[local], atol=5e-6, rtol=1e-5)
            compare_full(model, reference, parity, f"{label} after training", grads=False)


def test_inference_mode_and_no_grad_forwards_change_nothing() -> None:
    run_distributed(_inference_forwards_change_nothing, 2)


def _dtype_change_taken_in_under_inference_mode(rank: int, world_size: int) -> None:
    """``model.double()`` after sharding is taken in at the next forward; that
    forward under inference mode must not leave inference tensors behind."""
    local = _local(rank, world_size)
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model).double()
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    model.double()
    with torch.inference_mode():
        model(batch(50)[0][local])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    parity = Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD), atol=1e-10, rtol=1e-10)
    for step in range(2):
        inputs, targets = batch(step)
        _step(reference, inputs, targets)
        _step(model, inputs[local], targets[local])
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"float64 step {step}", grads=False)


def test_a_dtype_change_taken_in_under_inference_mode_changes_nothing() -> None:
    run_distributed(_dtype_change_taken_in_under_inference_mode, 2)
