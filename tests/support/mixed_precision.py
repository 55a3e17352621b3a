"""Owns: the low-precision parity recipe the mixed-precision tests share — a
case (how to build, shard, cast the reference and step), the data-parallel
low-precision reference, tolerances, and the run that compares a sharded
model with it step by step.

Knows nothing of: which policy a test checks (cases are the callers').

[Note: the low-precision reference]
The reference keeps fp32 master weights and, for each rank's slice of the
global batch, runs forward and backward on a copy of them cast the way the
sharded units compute (bf16 with per-unit exceptions), then averages the
slices' gradients in fp32: data-parallel training in low precision, done in
one process. So the loss matches to fp32 round-off (each sample's forward is
the same bf16 arithmetic) and, with ``reduce_dtype=float32``, the gradients
too; with a bf16 reduction the gradients differ by the bf16 rounding of the
sum (tolerance: 2^-7 of the tensor's largest entry). A single bf16 reference
on the whole batch would differ from both by bf16 rounding of the batch sum,
which would hide a wrong dtype; the step-0 loss check separates bf16 from
fp32 compute by three orders of magnitude.

Both models are trained; before each step the reference's master weights are
set to the sharded model's (equal to fp32 round-off): otherwise a 1-ulp fp32
difference can flip a weight's bf16 rounding and later steps would compare
different bf16 models. Optimizer steps are compared right after they run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import fully_shard, unshard_params
from composable_shard.runtime.state import unit_states_under

from .comm_spies import CollectiveSpy
from .models import Block, batch, lm_loss
from .parity import StepSlack, adamw, assert_resharded

BF16 = torch.bfloat16
FP32 = torch.float32


def fp32_loss_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 on the (maybe bf16) logits."""
    loss = lm_loss(model(inputs).float(), targets)
    loss.backward()
    return loss.detach()


def cast_all(master: nn.Module, dtype: torch.dtype = BF16, keep_fp32: tuple[type[nn.Module], ...] = ()) -> nn.Module:
    """A copy of ``master`` with floating-point tensors in ``dtype``, except
    the own tensors of ``keep_fp32`` modules (never rounded through bf16)."""
    compute = copy.deepcopy(master)
    for module in compute.modules():
        if not isinstance(module, keep_fp32):
            module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return compute


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)


@dataclass
class PrecisionCase:
    name: str
    build: Callable[[], nn.Module]
    shard: Callable[[nn.Module], object]
    # The reference's compute copy of the fp32 master weights.
    make_compute: Callable[[nn.Module], nn.Module] = cast_all
    step_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = fp32_loss_step
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adamw
    # Gradients reduced in fp32 (tight) or bf16 (bf16 rounding of the sum).
    exact_reduction: bool = True
    grad_dtype: torch.dtype = FP32
    # Dtypes the reductions must use (spy on composable_shard.comm).
    reduce_dtypes: set[torch.dtype] = field(default_factory=lambda: {FP32})
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = batch
    steps: int = 3


def reference_step(master: nn.Module, case: PrecisionCase, inputs: torch.Tensor, targets: torch.Tensor, world_size: int):
    """Loss and fp32 gradients of data-parallel low-precision training
    (see [Note: the low-precision reference])."""
    total_loss = torch.zeros((), dtype=FP32)
    grads = {name: torch.zeros_like(p) for name, p in master.named_parameters()}
    for rank in range(world_size):
        local = slice(rank * inputs.shape[0] // world_size, (rank + 1) * inputs.shape[0] // world_size)
        compute = case.make_compute(master)
        total_loss += case.step_fn(compute, inputs[local], targets[local]).float()
        for name, param in compute.named_parameters():
            if param.grad is not None:
                grads[name] += param.grad.float()
    return total_loss / world_size, {name: grad / world_size for name, grad in grads.items()}


def tolerances(case: PrecisionCase, expected: torch.Tensor) -> dict[str, float]:
    if case.exact_reduction and case.grad_dtype == FP32:
        return dict(atol=2e-6, rtol=2e-5)
    scale = expected.abs().max().item()
    return dict(atol=2**-7 * scale + 1e-7, rtol=2**-7)


def run_mixed_precision_parity(case: PrecisionCase, rank: int, world_size: int) -> nn.Module:
    torch.manual_seed(0)
    model = case.build()
    master = copy.deepcopy(model)
    case.shard(model)
    for _, state in unit_states_under(model):
        for handle in state.handles:
            assert handle.sharded_flat_param.dtype == FP32, f"{case.name}: the master shard must stay fp32"
    optimizer, reference_optimizer = case.make_optimizer(model), case.make_optimizer(master)
    # What AdamW amplifies of the gradients' round-off ([Note: parity after
    # an adaptive step]); per step, as the master restarts from the model.
    slack = StepSlack()
    for step in range(case.steps):
        when = f"{case.name}, step {step}"
        slack.bounds.clear()
        with unshard_params(model, writeback=False), torch.no_grad():
            for param, master_param in zip(model.parameters(), master.parameters()):
                master_param.copy_(param)
        inputs, targets = case.make_batch(step)
        reference_loss, reference_grads = reference_step(master, case, inputs, targets, world_size)
        local = slice(rank * inputs.shape[0] // world_size, (rank + 1) * inputs.shape[0] // world_size)
        spy = CollectiveSpy()
        with spy.watching():
            loss = case.step_fn(model, inputs[local], targets[local]).float()
        reductions = {dtype for _, dtype in spy.reductions_issued()}
        if world_size > 1:
            assert reductions == case.reduce_dtypes, f"{when}: reduced in {reductions}, expected {case.reduce_dtypes}"
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world_size, reference_loss, atol=2e-6, rtol=2e-6, msg=lambda m: f"{when}, loss: {m}")
        assert_resharded(model)
        for name, param in model.named_parameters():
            assert param.dtype == FP32, f"{when}: {name} is {param.dtype} outside forward"
            if param.grad is not None:
                assert param.grad.dtype == case.grad_dtype, f"{when}: grad of {name} is {param.grad.dtype}"
        with unshard_params(model, with_grads=True, writeback=False):
            for name, param in model.named_parameters():
                expected = reference_grads[name]
                torch.testing.assert_close(
                    param.grad.float(), expected, **tolerances(case, expected), msg=lambda m: f"{when}, grad of {name}: {m}"
                )
                slack.record_grad(name, param.grad, expected)
        for name, master_param in master.named_parameters():
            master_param.grad = reference_grads[name]
        if case.grad_dtype != FP32:  # an optimizer that takes low-precision grads: upcast first
            for param in model.parameters():
                if param.grad is not None:
                    param.grad = param.grad.float()
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        slack.account_steps(master, reference_optimizer)
        with unshard_params(model, writeback=False):
            for (name, param), master_param in zip(model.named_parameters(), master.parameters()):
                tolerance = dict(atol=2e-6, rtol=2e-5) if case.exact_reduction else dict(atol=2e-3, rtol=0.0)
                slack.assert_param_close(name, param, master_param, **tolerance, when=f"{when} after step")
    return model


def by_policy(**kwargs: object) -> Callable[[nn.Module], None]:
    return lambda model: fully_shard(model, policy={Block}, **kwargs)
