"""Backwards that accumulate no parameter gradient — ``autograd.grad`` over
inputs, with ``create_graph=True`` for a gradient penalty, or
``backward(inputs=...)`` — do not end the step: the penalty's double
backward matches a single process step by step, and the step after an
input-gradient-only backward trains exactly."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard
from composable_shard.runtime.state import TrainingState, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import DIM, SEQ, Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, shard_manually

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def _critic() -> nn.Module:
    return nn.Sequential(Block(), Block(), Block(), nn.LayerNorm(DIM), nn.Linear(DIM, 1))


def _shard_critic(strategy: ShardingStrategy):
    def shard(model: nn.Module) -> None:
        for block in list(model)[:3]:
            fully_shard(block, strategy=strategy)
        fully_shard(model, strategy=strategy)

    return shard


def _samples(step: int) -> torch.Tensor:
    return torch.randn(8, SEQ, DIM, generator=torch.Generator().manual_seed(500 + step))


def _penalised_loss(critic: nn.Module, samples: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's critic loss: the score plus the gradient penalty."""
    samples = samples.clone().requires_grad_()
    scores = critic(samples)
    (input_grad,) = torch.autograd.grad(scores.sum(), samples, create_graph=True)
    penalty = ((input_grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return scores.mean() + 10.0 * penalty


def _gradient_penalty_matches_reference(rank: int, world_size: int) -> None:
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for strategy in STRATEGIES:
        shard = _shard_critic(strategy)
        torch.manual_seed(0)
        model = _critic()
        reference = copy.deepcopy(model)
        shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        parity = Parity(build=_critic, shard=shard, atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
        for step in range(3):
            samples = _samples(step)
            _penalised_loss(reference, samples).backward()
            _penalised_loss(model, samples[local]).backward()
            assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"{strategy.name} step {step} after optimizer step", grads=False)


def test_gradient_penalty_double_backward_matches_single_process() -> None:
    run_distributed(_gradient_penalty_matches_reference, 2)


def _input_gradients_only_then_training(rank: int, world_size: int) -> None:
    """An input-gradient backward (a saliency map) between training steps:
    its result matches the reference; the units it gathered are held, not
    resharded mid-step, and the next forward or optimizer step ends that."""
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        shard_manually(strategy)(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        parity = Parity(build=TinyGPT, shard=shard_manually(strategy), atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
        for step in range(3):
            inputs, targets = batch(step)
            # Gradients with respect to a hidden state only, by both APIs.
            hidden = {}

            def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
                hidden["x"] = output

            for which, net, rows in (("model", model, local), ("reference", reference, slice(None))):
                handle = net.blocks[0].register_forward_hook(keep)
                logits = net(inputs[rows])
                handle.remove()
                if step == 1:
                    lm_loss(logits, targets[rows]).backward(inputs=[hidden["x"]])
                    input_grad = hidden["x"].grad
                else:
                    (input_grad,) = torch.autograd.grad(lm_loss(logits, targets[rows]), hidden["x"])
                hidden[which] = input_grad
            # The local mean's gradient is world_size times the global one's rows.
            torch.testing.assert_close(hidden["model"], hidden["reference"][local] * world_size, atol=5e-6, rtol=1e-5)
            assert all(p.grad is None for p in model.parameters()), "an input-gradient backward set a .grad"
            if step == 2:
                optimizer.step()  # ends the held state; no gradient, no change
            lm_loss(reference(inputs), targets).backward()
            lm_loss(model(inputs[local]), targets[local]).backward()
            assert all(state.training_state is TrainingState.IDLE for _, state in unit_states_under(model))
            compare_full(model, reference, parity, f"{strategy.name} step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()


def test_input_gradient_backwards_between_steps_change_nothing() -> None:
    run_distributed(_input_gradients_only_then_training, 2)


def _autograd_grad_over_parameters_then_training(rank: int, world_size: int) -> None:
    """``autograd.grad`` (and ``backward(inputs=...)``) over the original
    parameters is refused at once, naming the parameter, in every form of
    ``inputs`` (a list, a generator, one tensor, a dict); nothing is left
    mid-step: the next step trains exactly. Inputs that are not parameters
    (the gradient penalty's) still work, as the tests above show."""
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    parity = Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD), atol=5e-6, rtol=1e-5)
    inputs, targets = batch(0)
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        return lm_loss(model(inputs[local]), targets[local])

    forms = {
        "list": lambda: torch.autograd.grad(loss(), params, allow_unused=True),
        "generator": lambda: torch.autograd.grad(loss(), model.parameters()),
        "one tensor": lambda: torch.autograd.grad(loss(), params[-1]),
        "dict": lambda: torch.autograd.grad(loss(), {"w": params[0]}, allow_unused=True),
        "backward(inputs=...)": lambda: loss().backward(inputs=params[:2]),
    }
    for form, call in forms.items():
        if form == "dict" and "dict" not in str(inspect.signature(torch.autograd.grad)):
            continue  # older torch takes no dict of inputs
        with pytest.raises(RuntimeError, match=r"parameter '.*' of a fully_shard unit among its inputs"):
            call()
    lm_loss(reference(inputs), targets).backward()
    loss().backward()
    compare_full(model, reference, parity, "after autograd.grad over the parameters", grads=True)


def test_autograd_grad_over_original_parameters_is_refused_and_training_goes_on() -> None:
    run_distributed(_autograd_grad_over_parameters_then_training, 2)
