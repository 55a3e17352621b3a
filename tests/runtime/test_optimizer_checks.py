"""The optimizer step over a sharded model: a step between a forward and its
backward (or between two backwards of one forward, the graph kept with
``retain_graph=True``) makes that backward raise, as autograd does in a single process,
and the model then trains exactly as the reference that went through the
same sequence; LBFGS over sharded units is refused before changing
anything — at a step before the first forward too — and the model trains
on; a custom optimizer trains in parity undeclared (stepped whole by owners)
and declared with ``register_elementwise_optimizer`` (stepped as slices);
LBFGS over a NO_SHARD tree (whole tensors) is allowed and exact. FULL_SHARD
and SHARD_GRAD_OP at 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    ShardingStrategy,
    fully_shard,
    is_fully_sharded,
    register_elementwise_optimizer,
    set_reshard_after_backward,
    unshard,
)

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, adamw, assert_resharded, compare_full, run_parity, shard_manually

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    share = tensor.shape[0] // size
    return tensor[rank * share : (rank + 1) * share]


# ------------------------------------------- optimizer.step() inside a step
def _step_between_forward_and_backward(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        shard_manually(strategy)(model)
        optimizer, reference_optimizer = adamw(model), adamw(reference)
        parity = Parity(build=TinyGPT, shard=shard_manually(strategy), reference_optimizer=reference_optimizer)

        def step_then_refused_backward(step: int, loss: torch.Tensor, reference_loss: torch.Tensor) -> None:
            optimizer.step()
            reference_optimizer.step()
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                reference_loss.backward()
            with pytest.raises(RuntimeError, match=r"backward \(reaching unit '.*'\) of a forward that optimizer\.step\(\) was called after.*Call every backward of a forward before optimizer\.step\(\)"):
                loss.backward()
            assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} step {step} after the refused backward", grads=False)
            optimizer.zero_grad()
            reference_optimizer.zero_grad()

        def train(step: int, *, misuse: bool, two_forwards: bool = False, retained: str = "") -> None:
            inputs, targets = batch(step)
            if retained:  # backward(retain_graph=True), step, backward again through the same graph
                loss = lm_loss(model(_local(inputs)), _local(targets))
                reference_loss = lm_loss(reference(inputs), targets)
                if retained == "kept gathered":  # the step then finds something to free first
                    set_reshard_after_backward(model, False)
                loss.backward(retain_graph=True)
                reference_loss.backward(retain_graph=True)
                set_reshard_after_backward(model, True)
                compare_full(model, reference, parity, f"{strategy.name} step {step} first backward", grads=True)
                if retained == "explicit unshard":
                    unshard(model.blocks[1])
                # Before the fix: the first backward had left the tree idle,
                # the step went unremembered, and the second backward ran
                # with the stepped weights and the first forward's activations.
                step_then_refused_backward(step, loss, reference_loss)
                return
            if two_forwards:  # forward A, forward B, A's backward, step, B's backward
                other_inputs, other_targets = batch(step + 100)
                loss_a = lm_loss(model(_local(inputs)), _local(targets))
                loss_b = lm_loss(model(_local(other_inputs)), _local(other_targets))
                reference_a = lm_loss(reference(inputs), targets)
                reference_b = lm_loss(reference(other_inputs), other_targets)
                loss_a.backward()
                reference_a.backward()
                # Before the fix: A's backward had left the tree idle, the
                # step went unremembered, and B's backward ran silently.
                step_then_refused_backward(step, loss_b, reference_b)
                return
            if misuse:  # the previous step's gradients are still there
                loss = lm_loss(model(_local(inputs)), _local(targets))
                step_then_refused_backward(step, loss, lm_loss(reference(inputs), targets))
                return
            lm_loss(model(_local(inputs)), _local(targets)).backward()
            lm_loss(reference(inputs), targets).backward()
            compare_full(model, reference, parity, f"{strategy.name} step {step} after backward", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"{strategy.name} step {step} after the optimizer step", grads=False)

        # Gradients present, then the misuse; after it, exact training.
        inputs, targets = batch(0)
        lm_loss(model(_local(inputs)), _local(targets)).backward()
        lm_loss(reference(inputs), targets).backward()
        train(1, misuse=True)
        train(2, misuse=False)
        train(3, misuse=False, two_forwards=True)
        train(6, misuse=False)
        train(8, misuse=False, retained="plain")
        train(9, misuse=False)
        train(10, misuse=False, retained="kept gathered")
        train(11, misuse=False, retained="explicit unshard")
        train(12, misuse=False)
        # Two forwards, both backwards, then the step: nothing refused.
        for model_, inputs_, targets_ in ((model, _local(batch(7)[0]), _local(batch(7)[1])), (reference, *batch(7))):
            first = lm_loss(model_(inputs_), targets_)
            second = lm_loss(model_(inputs_.flip(0)), targets_.flip(0))
            first.backward()
            second.backward()
        compare_full(model, reference, parity, f"{strategy.name} two backwards", grads=True)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        # A forward without backward, then a step: allowed (evaluation
        # under grad mode), and the next step is exact.
        model(_local(batch(4)[0]))
        reference(batch(4)[0])
        optimizer.step()
        reference_optimizer.step()
        train(5, misuse=False)


def test_optimizer_step_between_forward_and_backward_raises_and_model_trains() -> None:
    run_distributed(_step_between_forward_and_backward, 2)


# ----------------------------------------------- optimizers not elementwise
def _closure_for(model: nn.Module, optimizer: torch.optim.Optimizer):
    inputs, targets = batch(0)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = lm_loss(model(_local(inputs)), _local(targets))
        loss.backward()
        return loss

    return closure


def _refusals_then_adamw(errors: list[str]):
    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        if not is_fully_sharded(model):
            return adamw(model)  # the reference
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        # Before the first forward (gradients set by hand), then with real gradients.
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        refused = torch.optim.LBFGS(model.parameters())
        with pytest.raises(RuntimeError, match=r"LBFGS couples all parameters") as error:
            refused.step(lambda: torch.zeros(()))
        errors.append(str(error.value))
        model.zero_grad(set_to_none=True)
        closure = _closure_for(model, refused)
        closure()
        with pytest.raises(RuntimeError, match=r"LBFGS couples all parameters") as error:
            refused.step(closure)
        errors.append(str(error.value))
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), before[name]), f"{name} changed by a refused step"
        model.zero_grad(set_to_none=True)
        return adamw(model)

    return make_optimizer


def _elementwise_update_class() -> type[torch.optim.Optimizer]:
    """A custom optimizer, elementwise (p -= lr * g * |g|); a new class per
    call, so a declaration in one call does not leak into the next."""

    class SquaredGradientDescent(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 0.5) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.addcmul_(param.grad, param.grad.abs(), value=-group["lr"])

    return SquaredGradientDescent


def _lbfgs_refused_custom_trains(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        errors: list[str] = []
        # The refusals, then AdamW: loss, gradients, parameters as the reference.
        run_parity(Parity(build=TinyGPT, shard=shard_manually(strategy), steps=2, make_optimizer=_refusals_then_adamw(errors)))
        assert len(errors) == 2 and all(message.startswith("LBFGS.step() over parameter '") for message in errors), errors
        for message in errors:
            assert "NO_SHARD or ignored_states" in message and "Nothing was updated." in message

        # A custom optimizer: undeclared (each whole parameter on its owner), then declared (slices).
        custom = _elementwise_update_class()
        run_parity(Parity(build=TinyGPT, shard=shard_manually(strategy), steps=2, make_optimizer=lambda m: custom(m.parameters())))
        assert register_elementwise_optimizer(custom) is custom
        run_parity(Parity(build=TinyGPT, shard=shard_manually(strategy), steps=2, make_optimizer=lambda m: custom(m.parameters())))


def test_lbfgs_refused_custom_optimizer_trains_declared_or_not() -> None:
    run_distributed(_lbfgs_refused_custom_trains, 2)


def _lbfgs_over_whole_tensors(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    fully_shard(model, strategy=ShardingStrategy.NO_SHARD)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1)
    reference_optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=1)
    inputs, targets = batch(0)
    initial = reference.head.weight.detach().clone()

    def reference_closure() -> torch.Tensor:
        reference_optimizer.zero_grad()
        loss = lm_loss(reference(inputs), targets)
        loss.backward()
        return loss

    optimizer.step(_closure_for(model, optimizer))
    reference_optimizer.step(reference_closure)
    parity = Parity(build=TinyGPT, shard=lambda m: None)
    compare_full(model, reference, parity, "NO_SHARD after one LBFGS step", grads=False)
    assert not torch.equal(reference.head.weight, initial)  # it moved


def test_lbfgs_over_a_no_shard_tree_is_allowed_and_exact() -> None:
    run_distributed(_lbfgs_over_whole_tensors, 2)


# ------------------------------------- every optimizer listed as elementwise
def _listed_optimizers_train_in_parity(rank: int, world_size: int) -> None:
    from composable_shard.runtime.optimizer_checks import ELEMENTWISE_OPTIMIZERS

    settings = {torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}}
    for optimizer_class in ELEMENTWISE_OPTIMIZERS:
        kwargs = settings.get(optimizer_class, {"lr": 1e-2})
        try:
            run_parity(Parity(
                build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD), steps=2,
                make_optimizer=lambda model: optimizer_class(model.parameters(), **kwargs),
            ))
        except AssertionError as error:
            raise AssertionError(f"{optimizer_class.__name__}: {error}") from error


def test_every_optimizer_listed_as_elementwise_trains_in_parity() -> None:
    run_distributed(_listed_optimizers_train_in_parity, 2)


def _loss_scalers(rank: int, world_size: int) -> None:
    """[Note: loss scaling over shards]: torch.amp.GradScaler over a sharded
    model raises at its first step, naming the parameter, nothing updated;
    FSDP1's ShardedGradScaler steps in parity with one process's GradScaler,
    and where only one rank's shard overflows every rank skips the step and
    halves its scale."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    shard = shard_manually(ShardingStrategy.FULL_SHARD)
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    parity = Parity(build=TinyGPT, shard=shard, atol=5e-6, reference_optimizer=reference_optimizer)
    inputs, targets = batch(0)
    before = [param.detach().clone() for param in model.parameters()]
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plain.scale(lm_loss(model(_local(inputs)), _local(targets))).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler\.step\(SGD\) over parameter '[^']+' of a fully_shard unit.*ShardedGradScaler"):
        plain.step(optimizer)
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before)), "the refused step updated"

    # A disabled scaler (the usual GradScaler(enabled=use_fp16)) decides
    # nothing: its step is the optimizer's, taken.
    for disabled in (torch.amp.GradScaler("cpu", enabled=False), ShardedGradScaler("cpu", enabled=False)):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        inputs, targets = batch(3)
        disabled.scale(lm_loss(model(_local(inputs)), _local(targets))).backward()
        lm_loss(reference(inputs), targets).backward()
        disabled.step(optimizer)
        disabled.update()
        reference_optimizer.step()
        compare_full(model, reference, parity, f"disabled {type(disabled).__name__}", grads=False)

    sharded = ShardedGradScaler("cpu", init_scale=2.0**10)
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        inputs, targets = batch(step)
        sharded.scale(lm_loss(model(_local(inputs)), _local(targets))).backward()
        reference_scaler.scale(lm_loss(reference(inputs), targets)).backward()
        for scaler, stepped in ((sharded, optimizer), (reference_scaler, reference_optimizer)):
            scaler.step(stepped)
            scaler.update()
        compare_full(model, reference, parity, f"ShardedGradScaler step {step}", grads=False)
    assert sharded.get_scale() == reference_scaler.get_scale()

    # An overflow in one rank's shard only: every rank skips, every scale halves.
    optimizer.zero_grad()
    inputs, targets = batch(2)
    loss = lm_loss(model(_local(inputs)), _local(targets))
    sharded.scale(loss * (float("inf") if rank == world_size - 1 else 1.0)).backward()
    with torch.no_grad():
        before = [param.detach().clone() for param in model.parameters()]
    scale = sharded.get_scale()
    sharded.step(optimizer)
    sharded.update()
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before)), "a rank stepped"
    assert sharded.get_scale() == scale / 2


def test_a_loss_scaler_of_one_rank_is_refused_and_sharded_grad_scaler_is_exact() -> None:
    run_distributed(_loss_scalers, 2)
