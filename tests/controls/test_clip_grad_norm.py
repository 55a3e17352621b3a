"""clip_grad_norm_: the global total norm over all shards equals
``torch.nn.utils.clip_grad_norm_`` on a single-process reference, for the
2-norm, the inf-norm and other p; the local shards are clipped exactly as the
reference's full gradients; frozen parameters and 0-numel local parts;
NO_SHARD and hybrid sharding without counting replicas twice; a CustomPolicy
mixing strategies; low-precision gradients."""

from __future__ import annotations

import copy
import math
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    CustomPolicy,
    MixedPrecision,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    unshard_params,
)

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, LoRAGPT, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, hybrid_groups, plain_step, run_parity

NORM_TYPES = (2.0, math.inf, 1.0, 3.0, 0.5)


def _shardings(world_size: int) -> dict[str, Callable[[nn.Module], None]]:
    def manual(strategy: ShardingStrategy, **kwargs: object) -> Callable[[nn.Module], None]:
        def shard(model: nn.Module) -> None:
            for block in model.blocks:
                fully_shard(block, strategy=strategy, **kwargs)
            fully_shard(model, strategy=strategy, **kwargs)

        return shard

    def mixed_strategies(model: nn.Module) -> None:
        def decide(module: nn.Module) -> bool | dict:
            if isinstance(module, nn.LayerNorm):
                return {"strategy": ShardingStrategy.NO_SHARD}
            if module is model.blocks[0]:
                return {"strategy": ShardingStrategy.SHARD_GRAD_OP}
            return isinstance(module, Block)

        fully_shard(model, policy=CustomPolicy(decide))

    hybrid = hybrid_groups(world_size)
    return {
        "FULL_SHARD": manual(ShardingStrategy.FULL_SHARD),
        "SHARD_GRAD_OP": manual(ShardingStrategy.SHARD_GRAD_OP),
        "NO_SHARD": manual(ShardingStrategy.NO_SHARD),
        "HYBRID_SHARD": manual(ShardingStrategy.HYBRID_SHARD, process_group=hybrid),
        "HYBRID_SHARD_ZERO2": manual(ShardingStrategy.HYBRID_SHARD_ZERO2, process_group=hybrid),
        "CustomPolicy mixing NO_SHARD, SHARD_GRAD_OP, FULL_SHARD": mixed_strategies,
    }


def _clipping_steps(max_norm: float, norm_type: float, totals: list[torch.Tensor], reference_totals: list[torch.Tensor]):
    """Step functions that clip after backward and record the total norms."""

    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = plain_step(model, inputs, targets)
        totals.append(clip_grad_norm_(model, max_norm, norm_type))
        return loss

    def reference_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = plain_step(model, inputs, targets)
        reference_totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        return loss

    return step, reference_step


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Updates linear in the (clipped) gradients: AdamW would normalise the
    clipping away and amplify round-off of near-zero gradients."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0, momentum=0.9)


def _max_norm_that_clips(norm_type: float) -> float:
    """Well below the models' gradient norms (so every step clips)."""
    return {1.0: 0.5, 0.5: 5.0}.get(norm_type, 0.05)


def _check_totals(totals: list[torch.Tensor], reference_totals: list[torch.Tensor], max_norm: float, what: str) -> None:
    assert len(totals) == len(reference_totals) > 0
    for step, (total, expected) in enumerate(zip(totals, reference_totals)):
        torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what}, step {step} total norm: {m}")
        assert expected > max_norm, f"{what}: the reference did not clip ({expected} <= {max_norm})"
        # Every rank returns the same global value.
        gathered = [torch.empty_like(total) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, total.contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: ranks disagree: {gathered}"


def _norm_and_clipped_grads_match_reference(rank: int, world_size: int, shardings: list[str]) -> None:
    for name in shardings:
        shard = _shardings(world_size)[name]
        for norm_type in NORM_TYPES:
            max_norm = _max_norm_that_clips(norm_type)
            totals: list[torch.Tensor] = []
            reference_totals: list[torch.Tensor] = []
            step, reference_step = _clipping_steps(max_norm, norm_type, totals, reference_totals)
            what = f"{name}, norm_type={norm_type}"
            # run_parity compares loss, full (clipped) gradients and
            # parameters with the reference after every step.
            parity = Parity(
                build=TinyGPT, shard=shard, steps=2, step_fn=step, reference_step_fn=reference_step, make_optimizer=_sgd
            )
            try:
                run_parity(parity)
            except AssertionError as error:
                raise AssertionError(f"{what}: {error}") from error
            _check_totals(totals, reference_totals, max_norm, what)


@pytest.mark.parametrize("world_size", [2, 4])
def test_total_norm_and_clipped_gradients_match_reference_for_every_strategy(world_size: int) -> None:
    run_distributed(
        _norm_and_clipped_grads_match_reference,
        world_size,
        ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "CustomPolicy mixing NO_SHARD, SHARD_GRAD_OP, FULL_SHARD"],
    )


def _frozen_empty_and_low_precision(rank: int, world_size: int) -> None:
    # Frozen parameters (LoRA) and, at 4 ranks, parameters with no local part.
    for norm_type in (2.0, math.inf, 3.0):
        max_norm = _max_norm_that_clips(norm_type)
        totals: list[torch.Tensor] = []
        reference_totals: list[torch.Tensor] = []
        step, reference_step = _clipping_steps(max_norm, norm_type, totals, reference_totals)

        def shard(model: nn.Module) -> None:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            assert any(p.numel() == 0 for p in model.parameters()) or world_size < 4

        run_parity(Parity(build=LoRAGPT, shard=shard, steps=2, step_fn=step, reference_step_fn=reference_step, make_optimizer=_sgd))
        _check_totals(totals, reference_totals, max_norm, f"LoRA, norm_type={norm_type}")

    # No clipping when the norm is below max_norm: gradients unchanged.
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block})
    inputs, targets = batch(0)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    plain_step(model, inputs[local], targets[local])
    before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    total = clip_grad_norm_(model, max_norm=1e6)
    assert total > 0
    for grad, param in zip(before, model.parameters()):
        assert (grad is None and param.grad is None) or torch.equal(grad, param.grad)

    # Low-precision gradients (keep_low_precision_grads): the norm is
    # accumulated in fp32 and the bf16 gradients are scaled in place.
    torch.manual_seed(0)
    model = TinyGPT()
    mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    fully_shard(model, policy={Block}, mixed_precision=mixed_precision)
    lm_loss(model(inputs[local]).float(), targets[local]).backward()
    with unshard_params(model, with_grads=True, writeback=False):
        full_grads = [p.grad.float() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full_grads]))
    grads_before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(g.dtype == torch.bfloat16 for g in grads_before)
    total = clip_grad_norm_(model, max_norm=0.01)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-3)
    coefficient = 0.01 / (expected + 1e-6)
    for before_grad, param in zip(grads_before, [p for p in model.parameters() if p.grad is not None]):
        assert param.grad.dtype == torch.bfloat16
        torch.testing.assert_close(param.grad.float(), (before_grad.float() * coefficient), atol=1e-5, rtol=1e-2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_empty_local_parts_and_low_precision_grads(world_size: int) -> None:
    run_distributed(_frozen_empty_and_low_precision, world_size)


class _Sub(nn.Module):
    """A plain module: a child made a unit, and a Linear its parent's unit holds."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.own = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.inner(x))


def _clip_edges(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Sub(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    fully_shard(model[0].inner)
    fully_shard(model)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    per_rank = 8 // world_size
    reference(x).square().mean().backward()
    model(x[rank * per_rank : (rank + 1) * per_rank]).square().mean().backward()
    # The plain module's own Linear is its parent unit's shards: before, they
    # counted as whole tensors and each rank clipped by its own norm.
    expected = torch.nn.utils.clip_grad_norm_(reference[0].parameters(), 1e-3)
    total = clip_grad_norm_(model[0], 1e-3)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    with unshard_params(model, with_grads=True, writeback=False):
        for (name, param), theirs in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)

    # A NaN in the last rank's gradient shard only: the inf-norm is NaN on
    # every rank, as in one process (gloo's MAX dropped a peer's NaN).
    if rank == world_size - 1:
        with torch.no_grad():
            next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel() > 0).view(-1)[0] = math.nan
    assert torch.isnan(clip_grad_norm_(model, 1.0, norm_type=math.inf))
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=math.inf, error_if_nonfinite=True)

    # Orders no sum over shards gives (before: -inf clipped by the inf-norm, 0 divided by zero).
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for norm_type in (-math.inf, 0.0):
        with pytest.raises(ValueError, match=rf"norm_type={norm_type} is not supported; use a p-norm with p > 0 or inf"):
            clip_grad_norm_(model, 1.0, norm_type=norm_type)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before) if not a.isnan().any())


def test_clip_grad_norm_of_a_plain_submodule_nan_shards_and_unsupported_orders() -> None:
    run_distributed(_clip_edges, 2)


def _clip_errors(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(Linear\): no module in this tree was given to fully_shard"):
        clip_grad_norm_(nn.Linear(2, 2), 1.0)
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block})
    inputs, targets = batch(0)
    errors: list[Exception] = []

    def clip_in_hook(*args: object) -> None:
        try:
            clip_grad_norm_(model, 1.0)
        except RuntimeError as error:
            errors.append(error)

    def clip_in_backward(module: nn.Module, args: object, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: clip_in_hook())

    forward_hook = model.blocks[0].fc_in.register_forward_hook(clip_in_hook)
    backward_hook = model.blocks[1].fc_in.register_forward_hook(clip_in_backward)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    forward_hook.remove()
    backward_hook.remove()
    assert len(errors) == 2 and all("inside forward or backward" in str(e) for e in errors), errors
    # The model still trains and clips.
    plain_step(model, inputs, targets)
    assert clip_grad_norm_(model, 1.0) > 0


def test_clip_grad_norm_inside_forward_or_backward_raises() -> None:
    run_distributed(_clip_errors, 2)


def _clip_fp64(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    reference = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    per_rank = 8 // world_size
    for norm_type in (2.0, math.inf, 3.0):
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
        reference(x).square().mean().backward()
        model(x[rank * per_rank : (rank + 1) * per_rank]).square().mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, norm_type)
        if norm_type == 3.0:  # torch's own entry point over the shards
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type)
        else:
            total = clip_grad_norm_(model, 1e-3, norm_type)
        # fp64 throughout, as in one process: an fp32 norm (before) is off by
        # about 1e-8 relative, and so is every clipped gradient.
        assert total.dtype == torch.float64, (norm_type, total.dtype)
        torch.testing.assert_close(total, expected, rtol=1e-13, atol=0, msg=lambda m: f"norm_type={norm_type}: {m}")
        with unshard_params(model, with_grads=True, writeback=False):
            for (name, param), theirs in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(param.grad, theirs.grad, rtol=1e-12, atol=1e-18, msg=name)


def test_fp64_gradients_give_an_fp64_norm_and_clip_as_one_process() -> None:
    run_distributed(_clip_fp64, 2)
