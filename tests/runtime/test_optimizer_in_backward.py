"""Post-accumulate-grad hooks on the original parameters run once per
synchronised backward, after the reduction, with this rank's part of the
gradient in ``.grad`` (see [Note: user post-accumulate-grad hooks]): an
optimizer stepped and zeroed from each hook ("optimizer in backward") trains
in parity with a single-process reference stepped after backward, with and
without ``no_sync`` accumulation, with CPU offload, and matches the usual
loop under mixed precision."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
import torch.nn as nn

from composable_shard import CPUOffload, MixedPrecision, fully_shard, no_sync, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full


def _per_param_adamw(model: nn.Module) -> dict[nn.Parameter, torch.optim.Optimizer]:
    return {param: torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1, foreach=False) for param in model.parameters()}


def _step_in_backward(model: nn.Module, calls: list[tuple[str, int, int]]) -> list[Any]:
    """Register a per-parameter AdamW stepped and zeroed from each hook;
    ``calls`` records (name, grad numel, param numel) per hook run."""
    optimizers = _per_param_adamw(model)
    names = {param: name for name, param in model.named_parameters()}

    def hook(param: torch.Tensor) -> None:
        calls.append((names[param], param.grad.numel(), param.numel()))
        optimizers[param].step()
        optimizers[param].zero_grad()

    return [param.register_post_accumulate_grad_hook(hook) for param in model.parameters()]


def _shard(**kwargs: Any) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    return shard


def _optimizer_in_backward_matches_reference(rank: int, world_size: int) -> None:
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    cases = [
        ("plain", 1, {}, False),
        ("hooks registered before fully_shard", 1, {}, True),
        ("no_sync accumulation", 3, {}, False),
        ("cpu offload", 2, {"cpu_offload": CPUOffload(offload_params=True)}, False),
    ]
    for name, micro_batches, kwargs, hooks_first in cases:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        calls: list[tuple[str, int, int]] = []
        if hooks_first:
            handles = _step_in_backward(model, calls)
            _shard(**kwargs)(model)
        else:
            _shard(**kwargs)(model)
            handles = _step_in_backward(model, calls)
        parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
        for step in range(3):
            for micro in range(micro_batches):
                inputs, targets = batch(step * micro_batches + micro)
                lm_loss(reference(inputs), targets).backward()
                last = micro == micro_batches - 1
                calls.clear()
                with contextlib.nullcontext() if last else no_sync(model):
                    lm_loss(model(inputs[local]), targets[local]).backward()
                if not last:
                    assert calls == [], f"{name}: hooks ran inside no_sync: {calls[:3]}"
                    continue
                # Each parameter's hooks once (the tied head/embedding is one
                # parameter), with this rank's part of its gradient.
                expected = [n for n, _ in model.named_parameters()]
                assert sorted(n for n, _, _ in calls) == sorted(expected), f"{name}: {calls}"
                assert all(grad == numel for _, grad, numel in calls), f"{name}: {calls}"
                # Backward order: the last block's parameters first, the root's last.
                blocks = [int(n.split(".")[1]) for n, _, _ in calls if n.startswith("blocks.")]
                assert blocks == sorted(blocks, reverse=True), f"{name}: {blocks}"
                assert calls[-1][0] in ("tok_emb.weight", "pos_emb", "norm.weight", "norm.bias"), f"{name}: {calls}"
            assert_resharded(model)
            assert all(p.grad is None for p in model.parameters()), f"{name}: the hooks zeroed every gradient"
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"{name}, step {step}", grads=False)
        for handle in handles:
            handle.remove()
        # Removed hooks no longer run: the usual loop takes over.
        calls.clear()
        inputs, targets = batch(99)
        lm_loss(model(inputs[local]), targets[local]).backward()
        assert calls == [] and all(p.grad is not None for p in model.parameters()), name


def test_optimizer_in_backward_matches_reference_with_and_without_no_sync() -> None:
    run_distributed(_optimizer_in_backward_matches_reference, 2)


def _optimizer_in_backward_under_mixed_precision(rank: int, world_size: int) -> None:
    """bf16 compute, fp32 reduction: stepping from the hooks gives the same
    parameters as stepping after backward (itself tested against a reference
    in tests/training/test_mixed_precision.py)."""
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = TinyGPT()
    usual = copy.deepcopy(model)
    for module in (model, usual):
        _shard(mixed_precision=policy)(module)
    calls: list[tuple[str, int, int]] = []
    _step_in_backward(model, calls)
    usual_optimizers = _per_param_adamw(usual)
    for step in range(3):
        inputs, targets = batch(step)
        for module in (model, usual):
            lm_loss(module(inputs[local]).float(), targets[local]).backward()
        assert len(calls) == len(list(model.parameters())), calls
        calls.clear()
        for optimizer in usual_optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        with unshard_params(model, writeback=False), unshard_params(usual, writeback=False):
            for (name, param), expected in zip(model.named_parameters(), usual.parameters()):
                torch.testing.assert_close(param, expected, atol=0, rtol=0, msg=lambda m: f"step {step}, {name}: {m}")


def test_optimizer_in_backward_under_mixed_precision() -> None:
    run_distributed(_optimizer_in_backward_under_mixed_precision, 2)


def _torch_apply_optimizer_in_backward(rank: int, world_size: int) -> None:
    """torch's ``_apply_optimizer_in_backward`` (as FSDP1's
    test_fsdp_optimizer_overlap uses it), with and without its hook: each
    parameter's optimizer steps once per synchronised backward, ``.grad`` is
    cleared, and training matches the reference stepped after backward
    (before: the parameters never moved, silently)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for register_hook in (True, False):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        _shard()(model)
        _apply_optimizer_in_backward(
            torch.optim.AdamW, model.parameters(), {"lr": 1e-2, "weight_decay": 0.1, "foreach": False},
            register_hook=register_hook,
        )
        parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
        for step in range(3):
            inputs, targets = batch(step)
            lm_loss(reference(inputs), targets).backward()
            lm_loss(model(inputs[local]), targets[local]).backward()
            assert all(p.grad is None for p in model.parameters()), f"register_hook={register_hook}"
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"register_hook={register_hook}, step {step}", grads=False)


def test_torch_apply_optimizer_in_backward_steps_each_parameter() -> None:
    run_distributed(_torch_apply_optimizer_in_backward, 2)
