"""Owns: the parity recipe — train a sharded model and a deep-copied
single-process reference on the global batch side by side, and compare loss,
full gradients and full parameters after every step, parameters within the
bound that the reference's adaptive steps put on round-off
(``StepSlack``, [Note: parity after an adaptive step]).

Knows nothing of: which feature is under test (callers pass how to shard,
how to run a step, and the optimizer).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composable_shard import ShardingStrategy, fully_shard, unshard_params
from composable_shard.runtime.state import unit_states_under

from .models import batch, lm_loss

StepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@dataclass
class Parity:
    """One parity run: how to build, shard, step and optimise."""

    build: Callable[[], nn.Module]
    shard: Callable[[nn.Module], object]
    steps: int = 3
    step_fn: StepFn = plain_step
    reference_step_fn: StepFn = plain_step
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adamw
    # Build the optimizer on the unsharded model, before fully_shard.
    optimizer_before_shard: bool = False
    # Data-parallel rank and size (differs from the global ones only when a
    # test shards over a subgroup).
    dp_rank: int | None = None
    dp_size: int | None = None
    global_batch: int = 8
    # Where the models compute (the batch is moved there).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    atol: float = 2e-6
    rtol: float = 1e-5
    compared: list[str] = field(default_factory=list)
    # The reference's optimizer, when the comparison after its steps should
    # allow what they amplify of the gradients' round-off ([Note: parity
    # after an adaptive step]); run_parity and step_and_compare set it.
    reference_optimizer: torch.optim.Optimizer | None = None
    slack: StepSlack = field(default_factory=lambda: StepSlack())
    # Whether every unit must be resharded after each step (False where a
    # unit is kept gathered on purpose: set_reshard_after_backward(False)).
    check_resharded: bool = True


class StepSlack:
    """Per element, how far the reference's optimizer steps may have moved
    a sharded model's parameters away from the reference's without a bug:
    [Note: parity after an adaptive step].

    [Note: parity after an adaptive step]
    The sharded gradients equal the reference's up to round-off (another
    summation order), and ``compare_full`` checks that tightly before every
    step. Adam and AdamW then step each element by lr * m / (sqrt(v) + eps):
    where the gradient's history is within round-off of zero, a round-off
    difference in it is a sizeable part of m and sqrt(v), so the two models
    can step such an element by different fractions of lr, which no fixed
    tolerance on parameters covers (seen: 1 element of tok_emb.weight of the
    pipeline test, 1.05e-5 apart after one step at lr 1e-2, on one CPU kind
    and not another). The bound is the reference's own sensitivity: with d
    the largest gradient difference measured on the element so far (m and
    v are averages of the gradients, so they differ by at most d and
    sqrt(v) by at most d), the step differs by at most
    lr * (1 + |m| / (sqrt(v) + eps)) * d / (sqrt(v) + eps), first order,
    doubled for what the first order leaves out; the bounds add up over
    steps. Elements with ordinary gradients get a slack far below the
    tolerance (d ~ 1e-9, sqrt(v) ~ 1e-3: ~4e-8 at lr 1e-2), so only those
    the step really amplifies are loosened. RMSprop and Adagrad step by
    lr * g / s with s = sqrt(w) + eps, w a weighted sum of squared
    gradients v (weights summing to at most 1 for RMSprop; Adagrad's sum
    holds this g^2 whole), less the square of their weighted mean m where
    RMSprop is centered: v moves by at most 2 * d * sqrt(v) (Cauchy-Schwarz)
    and m^2 by at most 2 * d * sqrt(v) too (|m| <= sqrt(v)), so s moves by
    at most D = min(2 * d * sqrt(v) / sqrt(w), sqrt(4 * d * sqrt(v))) (d
    where not centered) and g / s by at most d / s + |g| * D / s^2; with
    momentum mu the buffer's change adds up as mu * previous + this one;
    doubled and times lr as for Adam (not centered, no momentum: the Adam
    form with |g| for |m|; seen: 1 element of 768 under RMSprop, 1.09e-5
    apart after one step at lr 1e-2, with ATen's AVX2 kernels and not its
    AVX-512 ones). Those types exactly; other optimizers get no slack.
    """

    def __init__(self) -> None:
        # Per parameter name: the largest |model grad - reference grad| seen, per element.
        self.grad_differences: dict[str, torch.Tensor] = {}
        # Per parameter name: |reference grad| of the latest step, per element (RMSprop, Adagrad).
        self.reference_grads: dict[str, torch.Tensor] = {}
        # Per parameter name: how far RMSprop's momentum buffer may have moved, per element.
        self.momentum_changes: dict[str, torch.Tensor] = {}
        # Per parameter name: the summed bound of the steps accounted so far, per element.
        self.bounds: dict[str, torch.Tensor] = {}
        # Per parameter name: the reference optimizer's step count already accounted.
        self.accounted_steps: dict[str, float] = {}
        # The optimizer those steps are of (another one starts the bounds anew).
        self.optimizer: torch.optim.Optimizer | None = None

    def record_grad(self, name: str, grad: torch.Tensor, reference_grad: torch.Tensor) -> None:
        difference = (grad.detach().float() - reference_grad.detach().float()).abs()
        seen = self.grad_differences.get(name)
        self.grad_differences[name] = difference if seen is None else torch.maximum(seen, difference)
        self.reference_grads[name] = reference_grad.detach().float().abs()

    def account_steps(self, reference: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Add the bound of every step ``optimizer`` took on ``reference``'s
        parameters since the last call (it reads the optimizer's state)."""
        kind = _slack_kind(optimizer)
        if kind is None:
            return
        if optimizer is not self.optimizer:
            self.optimizer, self.bounds, self.accounted_steps, self.momentum_changes = optimizer, {}, {}, {}
        groups = {id(param): group for group in optimizer.param_groups for param in group["params"]}
        for name, param in reference.named_parameters():
            state, group = optimizer.state.get(param), groups.get(id(param))
            if state and group is not None:
                self.account_state(name, state, group, kind=kind)

    def account_state(self, name: str, state: dict, group: dict, *, kind: str = "adam") -> None:
        """Add the bound of the step an optimizer of ``kind`` (``"adam"``:
        Adam or AdamW, ``"rmsprop"``, ``"adagrad"``) took on parameter
        ``name`` with ``state`` (its state after the step) and ``group`` (its
        hyperparameters), unless that step was accounted already; a caller
        that recorded the reference's steps as it went passes them here one
        by one."""
        difference = self.grad_differences.get(name)
        if difference is None:
            return
        step = float(state["step"])
        if step <= self.accounted_steps.get(name, 0.0):
            return
        self.accounted_steps[name] = step
        lr = float(group["lr"])
        if kind == "adam":
            beta1, beta2 = group["betas"]
            second = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
            denominator = (second.float() / (1 - beta2**step)).sqrt() + group["eps"]
            update = (state["exp_avg"].float() / (1 - beta1**step)).abs() / denominator
            bound = 2 * lr * (1 + update) * difference / denominator
        else:
            squares = (state["square_avg"] if kind == "rmsprop" else state["sum"]).float()
            spread, moved = squares, difference
            if kind == "rmsprop" and group["centered"]:
                spread = (squares - state["grad_avg"].float() ** 2).clamp(min=0)
                root = squares.sqrt()
                moved = torch.minimum(2 * difference * root / spread.sqrt().clamp(min=1e-30), (4 * difference * root).sqrt())
            denominator = spread.sqrt() + group["eps"]
            change = difference / denominator + self.reference_grads[name] * moved / denominator**2
            if kind == "rmsprop" and group["momentum"]:
                change = change + group["momentum"] * self.momentum_changes.get(name, 0.0)
                self.momentum_changes[name] = change
            if kind == "adagrad":
                lr /= 1 + (step - 1) * group["lr_decay"]
            bound = 2 * lr * change
        self.bounds[name] = bound + self.bounds.get(name, 0.0)

    def assert_param_close(
        self, name: str, actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, when: str
    ) -> None:
        """``assert_close`` where each element may first differ by its bound."""
        bound = self.bounds.get(name)
        if bound is not None:
            actual, expected = actual.detach().float(), expected.detach().float()
            difference = actual - expected
            actual = expected + difference.sign() * (difference.abs() - bound).clamp(min=0)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{when}, parameter {name}: {m}")


def _slack_kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    """Which bound of [Note: parity after an adaptive step] ``optimizer``'s
    steps get (exact types: a subclass may step otherwise), or None."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if type(optimizer) is torch.optim.RMSprop:
        return "rmsprop"
    if type(optimizer) is torch.optim.Adagrad:
        return "adagrad"
    return None


def assert_resharded(model: nn.Module) -> None:
    """No unsharded parameter storage may stay allocated between steps."""
    for name, state in unit_states_under(model):
        for handle in state.handles:
            held = handle.unsharded_storage_bytes()
            if held:
                raise AssertionError(f"unit '{name}' still holds {held} bytes of unsharded parameters")


def run_parity(parity: Parity) -> list[float]:
    """Train both models; raise on the first mismatch. Returns the losses."""
    dp_rank = dist.get_rank() if parity.dp_rank is None else parity.dp_rank
    dp_size = dist.get_world_size() if parity.dp_size is None else parity.dp_size
    torch.manual_seed(0)
    model = parity.build().to(parity.device)
    reference = copy.deepcopy(model)
    if parity.optimizer_before_shard:
        optimizer = parity.make_optimizer(model)
        parity.shard(model)
    else:
        parity.shard(model)
        optimizer = parity.make_optimizer(model)
    reference_optimizer = parity.make_optimizer(reference)
    parity.reference_optimizer = reference_optimizer
    losses = []
    for step in range(parity.steps):
        inputs, targets = (t.to(parity.device) for t in batch(step, parity.global_batch))
        reference_loss = parity.reference_step_fn(reference, inputs, targets)
        local = slice(dp_rank * parity.global_batch // dp_size, (dp_rank + 1) * parity.global_batch // dp_size)
        loss = parity.step_fn(model, inputs[local], targets[local])
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
        torch.testing.assert_close(mean_loss, reference_loss, atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"step {step} loss: {m}")
        if parity.check_resharded:
            assert_resharded(model)
        at_params = functools.partial(_reference_grads_at, reference, parity, inputs, targets)
        compare_full(model, reference, parity, f"step {step} after backward", grads=True, reference_grads_at=at_params)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"step {step} after optimizer step", grads=False)
        losses.append(reference_loss.item())
    return losses


def compare_full(
    model: nn.Module,
    reference: nn.Module,
    parity: Parity,
    when: str,
    *,
    grads: bool,
    reference_grads_at: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor | None]] | None = None,
) -> None:
    """Full parameters (and gradients) of ``model`` equal ``reference``'s;
    after steps of ``parity.reference_optimizer``, parameters within what
    they amplify of the gradients' round-off ([Note: parity after an
    adaptive step]), and a gradient that differs from the reference's
    beyond round-off there is compared with ``reference_grads_at`` the
    model's own parameters ([Note: gradients after an adaptive step])."""
    reference_params = dict(reference.named_parameters())
    parity.slack.account_steps(reference, parity.reference_optimizer)
    at_model_params: dict[str, torch.Tensor | None] | None = None
    with unshard_params(model, with_grads=grads, writeback=False):
        for name, param in model.named_parameters():
            expected = reference_params[name]
            parity.slack.assert_param_close(name, param, expected, atol=parity.atol, rtol=parity.rtol, when=when)
            if not grads:
                continue
            if expected.grad is None:
                if param.grad is not None and param.grad.count_nonzero():
                    raise AssertionError(f"{when}: {name} has a gradient, the reference has none")
                continue
            if param.grad is None:
                raise AssertionError(f"{when}: {name} has no gradient, the reference has one")
            try:
                torch.testing.assert_close(
                    param.grad, expected.grad, atol=parity.atol, rtol=parity.rtol, msg=lambda m: f"{when}, gradient of {name}: {m}"
                )
            except AssertionError:
                # [Note: gradients after an adaptive step]
                if (
                    reference_grads_at is None
                    or name not in parity.slack.bounds
                    or any(isinstance(p, DTensor) or isinstance(p.grad, DTensor) for p in model.parameters())
                ):
                    raise
                if at_model_params is None:
                    at_model_params = reference_grads_at({n: p.detach() for n, p in model.named_parameters()})
                torch.testing.assert_close(
                    param.grad, at_model_params[name], atol=parity.atol, rtol=parity.rtol,
                    msg=lambda m: f"{when}, gradient of {name} against the reference's at the model's parameters: {m}",
                )
            if not isinstance(param.grad, DTensor) and param.grad.shape == expected.grad.shape:
                parity.slack.record_grad(name, param.grad, expected.grad)
            parity.compared.append(name)


def _reference_grads_at(
    reference: nn.Module, parity: Parity, inputs: torch.Tensor, targets: torch.Tensor, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor | None]:
    """The reference's gradients on this step's global batch at ``params``
    (the model's full parameters) instead of its own.

    [Note: gradients after an adaptive step]
    Once an adaptive step loosened the parameters by their bound ([Note:
    parity after an adaptive step]), the next gradients differ from the
    reference's by that difference carried through the network as well as
    by round-off: on wide layers (hidden 4,096) 1 element of 65,536 came
    2.1e-6 apart, past the fixed tolerance, with every layout. Where a
    gradient differs past it, it is compared, at the same tolerance, with
    the gradient a copy of the reference computes at the model's own
    parameters on the same batch: the sharded gradient must be that one,
    up to round-off. The copy runs with the random state forked, so the
    reference's own steps see the same numbers as without it."""
    twin = copy.deepcopy(reference)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            param.copy_(params[name])
    twin.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[parity.device] if parity.device.type == "cuda" else []):
        parity.reference_step_fn(twin, inputs, targets)
    return {name: param.grad for name, param in twin.named_parameters()}


def step_and_compare(
    model: nn.Module, reference: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], parity: Parity, when: str
) -> None:
    """Compare parameters and gradients (``when``), step and zero every
    optimizer, then compare parameters again ("``when`` after optimizer step");
    the optimizer over ``reference``'s parameters becomes
    ``parity.reference_optimizer``."""
    compare_full(model, reference, parity, when, grads=True)
    reference_ids = {id(param) for param in reference.parameters()}
    for optimizer in optimizers:
        if any(id(param) in reference_ids for group in optimizer.param_groups for param in group["params"]):
            parity.reference_optimizer = optimizer
        optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad()
    compare_full(model, reference, parity, f"{when} after optimizer step", grads=False)


def sgd_steps_in_parity(
    model: nn.Module, reference: nn.Module, steps: range, when: str, between: Callable[[], None] | None = None
) -> None:
    """For each step: the model's forward on this rank's slice of
    ``batch(step)`` (then ``between()``, where given) and its backward, the
    reference's on the whole batch, full gradients compared, then both
    updated by plain SGD (lr 0.1) and their gradients cleared."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    parity = Parity(build=lambda: reference, shard=lambda module: None)
    for step in steps:
        inputs, targets = batch(step)
        loss = lm_loss(model(inputs[local]), targets[local])
        if between is not None:
            between()
        loss.backward()
        lm_loss(reference(inputs), targets).backward()
        compare_full(model, reference, parity, f"{when}, step {step}", grads=True)
        for module in (model, reference):
            with torch.no_grad():
                for param in module.parameters():
                    if param.grad is not None:
                        param -= 0.1 * param.grad
            module.zero_grad(set_to_none=True)


def hybrid_groups(world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups for hybrid sharding tests: 2x2 at 4 ranks,
    1 x world_size otherwise. Every rank creates every group."""
    shard_size = 2 if world_size == 4 else 1
    rank = dist.get_rank()
    shard_group = replicate_group = None
    for start in range(0, world_size, shard_size):
        group = dist.new_group(list(range(start, start + shard_size)))
        if rank in range(start, start + shard_size):
            shard_group = group
    for offset in range(shard_size):
        group = dist.new_group(list(range(offset, world_size, shard_size)))
        if rank % shard_size == offset:
            replicate_group = group
    return shard_group, replicate_group  # type: ignore[return-value]  # this rank is in one of each


def shard_manually(strategy: ShardingStrategy, **kwargs: object):
    """How to shard a TinyGPT: each block, then the root, all with ``strategy``."""

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy, **kwargs)
        fully_shard(model, strategy=strategy, **kwargs)

    return shard
