"""Parity of fully_shard composed with what real training does: every form
of activation checkpointing, optimizer parameter groups, frozen parameters,
several forwards before one backward, eval forwards between steps, a unit
unused in some iterations, and inputs that require grad."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, LoRAGPT, TinyGPT, function_checkpoint_gpt, lm_loss
from tests.support.parity import Parity, assert_resharded, plain_step, run_parity


def _shard_blocks_and_root(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _shard_fc_in_and_root(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block.fc_in)
    fully_shard(model)


def _wrapper_checkpoint_gpt() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = TinyGPT()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
    return model


def _shard_with_composable_checkpoint(model: nn.Module) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for block in model.blocks:
        composable_checkpoint(block)
        fully_shard(block)
    fully_shard(model)


def _hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def _counting_hooks(step_fn):
    """A step that also checks no hook was registered twice."""

    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        before = _hook_counts(model)
        loss = step_fn(model, inputs, targets)
        assert _hook_counts(model) == before, "a step registered module hooks"
        return loss

    return step


def _checkpointing_matches_reference(rank: int, world_size: int) -> None:
    cases = {
        "checkpoint(use_reentrant=False)": (functools.partial(function_checkpoint_gpt, False), _shard_blocks_and_root),
        "checkpoint(use_reentrant=True)": (functools.partial(function_checkpoint_gpt, True), _shard_blocks_and_root),
        # [Note: reentrant checkpoints inside a unit]: several regions in one
        # unit (before: the second recomputed on 1-D shards and raised).
        "checkpoint(use_reentrant=True), the root the only unit": (
            functools.partial(function_checkpoint_gpt, True),
            fully_shard,
        ),
        "checkpoint(use_reentrant=True), NO_SHARD root": (
            functools.partial(function_checkpoint_gpt, True),
            functools.partial(fully_shard, strategy=ShardingStrategy.NO_SHARD),
        ),
        "checkpoint(use_reentrant=True), regions holding units": (
            functools.partial(function_checkpoint_gpt, True),
            _shard_fc_in_and_root,
        ),
        "checkpoint_wrapper": (_wrapper_checkpoint_gpt, _shard_blocks_and_root),
        "_composable.checkpoint": (TinyGPT, _shard_with_composable_checkpoint),
    }
    for name, (build, shard) in cases.items():
        try:
            run_parity(Parity(build=build, shard=shard, step_fn=_counting_hooks(plain_step)))
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_activation_checkpointing_form_matches_reference(world_size: int) -> None:
    run_distributed(_checkpointing_matches_reference, world_size)


def _param_groups_by_name(model: nn.Module) -> list[dict]:
    """Decay on matrices, none on norms, biases and embeddings, chosen by
    name (after fully_shard every local parameter is 1-D)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = name.endswith("weight") and "norm" not in name and "emb" not in name
        (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _param_groups_match_reference(rank: int, world_size: int) -> None:
    groups_adamw = lambda model: torch.optim.AdamW(_param_groups_by_name(model), lr=1e-2)  # noqa: E731
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    for make_optimizer in (groups_adamw, sgd):
        for before in (False, True):
            run_parity(
                Parity(
                    build=TinyGPT,
                    shard=_shard_blocks_and_root,
                    make_optimizer=make_optimizer,
                    optimizer_before_shard=before,
                )
            )


@pytest.mark.parametrize("world_size", [2, 4])
def test_optimizer_parameter_groups_before_or_after_sharding_match_reference(world_size: int) -> None:
    run_distributed(_param_groups_match_reference, world_size)


def _frozen_parameters_match_reference(rank: int, world_size: int) -> None:
    def check_frozen_grads(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = plain_step(model, inputs, targets)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, f"frozen {name} got a gradient"
        return loss

    opt = lambda model: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    run_parity(Parity(build=LoRAGPT, shard=_shard_blocks_and_root, step_fn=check_frozen_grads, make_optimizer=opt))
    from composable_shard.runtime.state import get_state

    torch.manual_seed(0)
    model = LoRAGPT()
    _shard_blocks_and_root(model)
    kinds = [(h.layout.requires_grad, h.unsharded_flat_param.requires_grad) for h in get_state(model.blocks[0]).handles]
    assert sorted(kinds) == [(False, False), (True, True)], kinds


def _frozen_parameters_are_freed_before_backward_ends(rank: int, world_size: int) -> None:
    from composable_shard.runtime import hooks as runtime_hooks
    from composable_shard.runtime.state import get_state

    torch.manual_seed(0)
    model = LoRAGPT(n_blocks=3)
    _shard_blocks_and_root(model)
    held_at_end: list[int] = []
    real_finalize = runtime_hooks._finalize_backward

    def spy(context) -> None:  # calls through
        held_at_end.extend(
            h.unsharded_storage_bytes() for block in model.blocks for h in get_state(block).handles
        )
        real_finalize(context)

    runtime_hooks._finalize_backward = spy
    try:
        inputs, targets = batch_for(rank, world_size)
        lm_loss(model(inputs), targets).backward()
    finally:
        runtime_hooks._finalize_backward = real_finalize
    assert held_at_end and all(b == 0 for b in held_at_end), held_at_end
    assert_resharded(model)


def batch_for(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.support.models import batch

    inputs, targets = batch(0)
    per_rank = inputs.shape[0] // world_size
    return inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]


def test_frozen_flat_parameters_are_freed_during_backward_not_at_its_end() -> None:
    run_distributed(_frozen_parameters_are_freed_before_backward_ends, 2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_and_trainable_parameters_in_one_unit_match_reference(world_size: int) -> None:
    run_distributed(_frozen_parameters_match_reference, world_size)


def _two_forwards_one_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    half = inputs.shape[0] // 2
    loss = (lm_loss(model(inputs[:half]), targets[:half]) + lm_loss(model(inputs[half:]), targets[half:])) / 2
    loss.backward()
    return loss.detach()


def _eval_forward_then_train(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        model(inputs)
    assert_resharded(model)
    model.train()
    return plain_step(model, inputs, targets)


class _SkippingGPT(TinyGPT):
    """Skips its middle block on odd calls."""

    calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for index, block in enumerate(self.blocks):
            if index == 1 and self.calls % 2 == 0:
                continue
            x = block(x)
        return self.head(self.norm(x))


def _usage_patterns_match_reference(rank: int, world_size: int) -> None:
    cases = {
        "several forwards before one backward": (TinyGPT, _two_forwards_one_backward),
        "no_grad eval forward between steps": (TinyGPT, _eval_forward_then_train),
        "unit unused in some iterations": (_SkippingGPT, plain_step),
    }
    for name, (build, step) in cases.items():
        try:
            run_parity(Parity(build=build, shard=_shard_blocks_and_root, step_fn=step, reference_step_fn=step, steps=4))
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


@pytest.mark.parametrize("world_size", [2, 4])
def test_usage_patterns_match_reference(world_size: int) -> None:
    run_distributed(_usage_patterns_match_reference, world_size)


def _inputs_requiring_grad_match_reference(rank: int, world_size: int) -> None:
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    reference = copy.deepcopy(model)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(8, 5, 16, generator=generator)
    reference_inputs = inputs.clone().requires_grad_()
    reference(reference_inputs).square().mean().backward()
    per_rank = 8 // world_size
    local_inputs = inputs[rank * per_rank : (rank + 1) * per_rank].clone().requires_grad_()
    model(local_inputs).square().mean().backward()
    # Like DDP: parameter gradients are averaged over ranks, the input's is
    # the local loss's own (the reference's mean is over world_size times
    # more samples).
    expected = reference_inputs.grad[rank * per_rank : (rank + 1) * per_rank] * world_size
    torch.testing.assert_close(local_inputs.grad, expected, atol=1e-7, rtol=1e-5)
    with unshard_params(model, with_grads=True):
        for (name, param), expected_param in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected_param.grad, atol=1e-7, rtol=1e-5, msg=name)
    assert_resharded(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_inputs_that_require_grad_get_the_reference_gradient(world_size: int) -> None:
    run_distributed(_inputs_requiring_grad_match_reference, world_size)
