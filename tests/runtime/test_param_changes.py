"""Changes users make to the original parameters after ``fully_shard``, in
parity with a single-process reference that makes the same changes:

- ``requires_grad_`` flipped after sharding (staged unfreezing, freezing a
  layer mid fine-tuning): in the root and in blocks, whole units and parts of
  units, a flat parameter grouped frozen at ``fully_shard`` time unfrozen,
  under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, in fp32 and under mixed
  precision, with activation checkpointing, then a state-dict round trip. Frozen parameters get no
  ``.grad``, are not updated (AdamW with weight decay), and a flat parameter
  frozen as a whole is not reduced; a change while a ``no_sync`` gradient
  waits for its reduction is refused at the next forward.
- dtype casts of the sharded model (``.double()``, ``.to(torch.float64)``,
  with the swap-tensors conversion too): training goes on in float64, in
  parity with the reference cast the same way; a cast of part of a flat
  parameter is refused at the next forward and the model stays usable.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    MixedPrecision,
    describe,
    ShardingStrategy,
    fully_shard,
    get_optimizer_state_dict,
    no_sync,
    set_optimizer_state_dict,
    unshard_params,
)
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_reductions_alone
from tests.support.harness_pool import run_distributed, world_sizes
from tests.support.harness_worker import run_subtests
from tests.support.mixed_precision import PrecisionCase, reference_step
from tests.support.models import TinyGPT, batch, function_checkpoint_gpt, lm_loss
from tests.support.parity import assert_resharded, plain_step, sgd_steps_in_parity, shard_manually

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
BF16_FP32_REDUCE = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(use_reentrant: bool | None = None) -> nn.Module:
    """TinyGPT with ``blocks.2.norm`` frozen before sharding, so that block 2
    has a flat parameter grouped frozen by ``fully_shard``; with
    ``use_reentrant`` set, its blocks run under activation checkpointing."""
    model = TinyGPT() if use_reentrant is None else function_checkpoint_gpt(use_reentrant)
    model.blocks[2].norm.requires_grad_(False)
    return model


def _shard(strategy: ShardingStrategy, mixed_precision: MixedPrecision | None) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy, mixed_precision=mixed_precision)
        fully_shard(model, strategy=strategy, mixed_precision=mixed_precision)

    return shard


def _change_requires_grad(model: nn.Module, step: int) -> None:
    """What the user changes before ``step``: the same on both models."""
    if step == 1:
        model.tok_emb.weight.requires_grad_(False)  # root, part of its flat parameter (tied to the head)
        model.blocks[0].fc_in.weight.requires_grad_(False)  # part of a block's flat parameter
        model.blocks[1].requires_grad_(False)  # a whole unit
    elif step == 2:
        model.blocks[1].fc_out.requires_grad_(True)  # part of a wholly frozen flat parameter back
        model.blocks[2].norm.requires_grad_(True)  # the flat parameter grouped frozen at fully_shard
        model.pos_emb.requires_grad_(False)
    elif step == 3:
        model.requires_grad_(True)
    elif step == 4:
        model.blocks[2].requires_grad_(False)  # both of its flat parameters
        model.norm.requires_grad_(False)
        # Used first in forward, so last in backward: the block's flat
        # gradient is complete before its LayerNorm's backward reads it.
        model.blocks[0].norm.requires_grad_(False)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _fp32_loss_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs).float(), targets)
    loss.backward()
    return loss.detach()


def _flat_params_with_grads(model: nn.Module, reference: nn.Module) -> int:
    """Flat parameters holding a trainable parameter the reference gave a
    gradient: the reductions one backward should cost (a frozen flat
    parameter none)."""
    has_grad = {name for name, param in reference.named_parameters() if param.requires_grad and param.grad is not None}
    count = 0
    for unit_name, state in unit_states_under(model):
        prefix = f"{unit_name}." if unit_name else ""
        for handle in state.handles:
            count += any(prefix + fqn in has_grad for info in handle.layout.params for fqn in info.fqns)
    return count


class _Reference:
    """The single-process reference: fp32 on the global batch, or (mixed
    precision) the data-parallel low-precision reference of
    test_mixed_precision (see its [Note: the low-precision reference])."""

    def __init__(self, model: nn.Module, mixed_precision: MixedPrecision | None, world_size: int) -> None:
        self.model = copy.deepcopy(model)
        self.mixed_precision = mixed_precision
        self.world_size = world_size
        self.case = PrecisionCase("reference", TinyGPT, lambda m: None)
        self.tolerance = dict(atol=2e-6, rtol=2e-5)

    def step(self, sharded: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.mixed_precision is None:
            return plain_step(self.model, inputs, targets)
        # Master weights follow the sharded model's (equal to fp32 round-off),
        # so that bf16 rounding cannot drift apart over steps.
        with unshard_params(sharded, writeback=False), torch.no_grad():
            for param, master in zip(sharded.parameters(), self.model.parameters()):
                master.copy_(param)
        loss, grads = reference_step(self.model, self.case, inputs, targets, self.world_size)
        for name, master in self.model.named_parameters():
            master.grad = grads[name] if master.requires_grad else None
        return loss


def _check_grads(model: nn.Module, reference: nn.Module, tolerance: dict[str, float], when: str) -> None:
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = reference_params[name]
        assert param.requires_grad == expected.requires_grad, f"{when}: {name} requires_grad differs"
        if expected.grad is None:
            assert param.grad is None, f"{when}: frozen {name} got a gradient on rank {dist.get_rank()}"
        else:
            assert param.grad is not None, f"{when}: {name} got no gradient on rank {dist.get_rank()}"
    with unshard_params(model, with_grads=True, writeback=False):
        for name, param in model.named_parameters():
            expected = reference_params[name]
            if expected.grad is not None:
                torch.testing.assert_close(
                    param.grad, expected.grad, **tolerance, msg=lambda m: f"{when}, grad of {name}: {m}"
                )


def _check_params(model: nn.Module, reference: nn.Module, tolerance: dict[str, float], when: str) -> None:
    reference_params = dict(reference.named_parameters())
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, reference_params[name], **tolerance, msg=lambda m: f"{when}, {name}: {m}")


def _requires_grad_changes_match_reference(
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None,
    rank: int,
    world_size: int,
    use_reentrant: bool | None = None,
    set_to_none: bool = True,
) -> None:
    torch.manual_seed(0)
    model = _build(use_reentrant)
    reference = _Reference(model, mixed_precision, world_size)
    _shard(strategy, mixed_precision)(model)
    optimizer, reference_optimizer = _adamw(model), _adamw(reference.model)
    step_fn = plain_step if mixed_precision is None else _fp32_loss_step
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for step in range(5):
        when = f"step {step}"
        _change_requires_grad(model, step)
        _change_requires_grad(reference.model, step)
        inputs, targets = batch(step)
        reference_loss = reference.step(model, inputs, targets)
        frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        spy = CollectiveSpy()
        with spy.watching():
            loss = step_fn(model, inputs[local], targets[local])
        dist.all_reduce(loss)
        torch.testing.assert_close(
            loss / world_size, reference_loss, atol=2e-6, rtol=2e-6, msg=lambda m: f"{when}, loss: {m}"
        )
        assert_resharded(model)
        reductions = spy.counts()["all_reduce" if strategy is ShardingStrategy.NO_SHARD else "reduce_scatter"]
        if world_size > 1:
            expected = _flat_params_with_grads(model, reference.model)
            assert reductions == expected, f"{when}: {reductions} reductions, {expected} flat parameters get gradients"
        _check_grads(model, reference.model, reference.tolerance, when)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        reference_optimizer.zero_grad(set_to_none=set_to_none)
        for name, before in frozen_before.items():
            # Zeroed (not None) gradients of frozen parameters stay, and
            # AdamW decays those parameters, in the reference too.
            unchanged = torch.equal(dict(model.named_parameters())[name], before)
            assert unchanged or not set_to_none, f"{when}: frozen {name} changed"
        _check_params(model, reference.model, reference.tolerance, f"{when} after optimizer step")
    if use_reentrant is None and set_to_none:
        _state_dict_round_trip(
            model, optimizer, reference, reference_optimizer, strategy, mixed_precision, rank, world_size
        )


def _state_dict_round_trip(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: _Reference,
    reference_optimizer: torch.optim.Optimizer,
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None,
    rank: int,
    world_size: int,
) -> None:
    """The trained model's state dicts load into a fresh sharded model with
    the same frozen parameters, which then trains on (unfreezing everything)
    in parity with the reference."""
    model_state = model.state_dict()
    for name, value in reference.model.state_dict().items():
        torch.testing.assert_close(
            model_state[name], value, **reference.tolerance, msg=lambda m: f"state dict {name}: {m}"
        )
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    torch.manual_seed(1)
    fresh = _build()
    _shard(strategy, mixed_precision)(fresh)
    for name, param in fresh.named_parameters():  # as trained: changed after sharding
        param.requires_grad_(dict(reference.model.named_parameters())[name].requires_grad)
    fresh.load_state_dict(model_state)
    fresh_optimizer = _adamw(fresh)
    set_optimizer_state_dict(fresh, fresh_optimizer, optimizer_state)
    _check_params(fresh, reference.model, reference.tolerance, "after loading")
    fresh.requires_grad_(True)
    reference.model.requires_grad_(True)
    inputs, targets = batch(5)
    reference_loss = reference.step(fresh, inputs, targets)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    loss = (plain_step if mixed_precision is None else _fp32_loss_step)(fresh, inputs[local], targets[local])
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world_size, reference_loss, atol=2e-6, rtol=2e-6)
    _check_grads(fresh, reference.model, reference.tolerance, "after loading")
    fresh_optimizer.step()
    reference_optimizer.step()
    _check_params(fresh, reference.model, reference.tolerance, "after loading, optimizer step")


@with_reductions_alone  # counts reductions per flat parameter
def _requires_grad_changes(rank: int, world_size: int) -> None:
    # One rank shards nothing: one strategy stands for all. Mixed precision
    # and checkpointing at two ranks; four ranks add empty local parts.
    strategies = STRATEGIES if world_size > 1 else STRATEGIES[:1]
    precisions = (None,) if world_size == 4 else (None, BF16_FP32_REDUCE)
    run_subtests(
        {"strategy": strategies, "mixed_precision": precisions},
        _requires_grad_changes_match_reference,
        rank=rank,
        world_size=world_size,
    )
    if world_size != 2:
        return
    run_subtests(  # gradients zeroed in place: frozen parameters keep theirs
        {"set_to_none": (False,)},
        _requires_grad_changes_match_reference,
        strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=None,
        rank=rank,
        world_size=world_size,
    )
    run_subtests(  # activation checkpointing re-runs forward with the frozen views
        {"use_reentrant": (False, True)},
        _requires_grad_changes_match_reference,
        strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=None,
        rank=rank,
        world_size=world_size,
    )


@world_sizes
def test_requires_grad_changes_after_sharding_match_reference(world_size: int) -> None:
    run_distributed(_requires_grad_changes, world_size, timeout=300)


def _requires_grad_change_inside_no_sync_is_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    _shard(ShardingStrategy.FULL_SHARD, None)(model)
    inputs, targets = batch(0)
    with no_sync(model):
        plain_step(model, inputs, targets)
    model.blocks[1].fc_in.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"blocks\.1\.fc_in\.weight.*no_sync"):
        model(inputs)
    # Usable: set back, the synchronised backward reduces, then freeze.
    model.blocks[1].fc_in.weight.requires_grad_(True)
    plain_step(model, inputs, targets)
    assert_resharded(model)
    model.blocks[1].fc_in.weight.requires_grad_(False)
    model.zero_grad()
    plain_step(model, inputs, targets)
    assert model.blocks[1].fc_in.weight.grad is None
    assert model.blocks[1].fc_out.weight.grad is not None


def test_requires_grad_change_inside_no_sync_is_refused_at_the_next_forward() -> None:
    run_distributed(_requires_grad_change_inside_no_sync_is_refused, 2)


def _frozen_parameter_runs_no_grad_hook(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    _shard(ShardingStrategy.FULL_SHARD, None)(model)
    calls: list[str] = []
    for name in ("fc_in.weight", "fc_out.weight"):
        model.blocks[0].get_parameter(name).register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
    inputs, targets = batch(0)
    expected: list[str] = []
    both = ["fc_out.weight", "fc_in.weight"]  # backward order
    for frozen, hooked in ((False, both), (True, ["fc_out.weight"]), (False, both)):
        model.blocks[0].fc_in.weight.requires_grad_(not frozen)
        model.zero_grad()
        plain_step(model, inputs, targets)
        expected += hooked
        assert calls == expected, (frozen, calls)


def test_frozen_parameter_runs_no_post_accumulate_grad_hook() -> None:
    run_distributed(_frozen_parameter_runs_no_grad_hook, 2)


def _describe_follows_requires_grad(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    _shard(ShardingStrategy.FULL_SHARD, None)(model)
    inputs, targets = batch(0)
    trained = describe(model).rank_bytes
    model.blocks[1].requires_grad_(False)
    plain_step(model, inputs, targets)  # the forward takes the change
    frozen = describe(model).rank_bytes
    block = get_state(model.blocks[1]).handles[0]  # type: ignore[union-attr]
    shard_bytes = block.layout.shard_numel * block.sharded_flat_param.element_size()
    assert trained["grads"] - frozen["grads"] == shard_bytes, (trained, frozen, shard_bytes)
    model.blocks[1].requires_grad_(True)
    plain_step(model, inputs, targets)
    assert describe(model).rank_bytes == trained


def test_describe_counts_gradients_of_parameters_trainable_now() -> None:
    run_distributed(_describe_follows_requires_grad, 2)


# ------------------------------------------------------------- dtype casts
def _casts() -> dict[str, Callable[[nn.Module], object]]:
    return {
        ".double()": lambda m: m.double(),
        ".to(torch.float64)": lambda m: m.to(torch.float64),
        ".to(dtype=torch.float64) with swapped tensors": _to_float64_swapping,
    }


def _to_float64_swapping(model: nn.Module) -> None:
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(dtype=torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _float64_after_cast_matches_reference(strategy: ShardingStrategy, cast: str, rank: int, world_size: int) -> None:
    """One fp32 step, then the cast (of the sharded model and of the
    reference) between backward and the optimizer step, then float64
    training (a new optimizer) at float64 round-off."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard(strategy, None)(model)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    tolerance = dict(atol=1e-12, rtol=1e-12)
    for step in range(4):
        when = f"{cast}, step {step}"
        inputs, targets = batch(step)
        reference_loss = plain_step(reference, inputs, targets)
        loss = plain_step(model, inputs[local], targets[local])
        if step == 0:
            _casts()[cast](model)
            _casts()[cast](reference)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        elif step == 1:
            optimizer, reference_optimizer = _adamw(model), _adamw(reference)
        if step > 0:
            assert loss.dtype == torch.float64, f"{when}: loss is {loss.dtype}"
        dist.all_reduce(loss)
        step_tolerance = tolerance if step > 0 else dict(atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(
            loss.double() / world_size, reference_loss.double(), **step_tolerance, msg=lambda m: f"{when}, loss: {m}"
        )
        assert_resharded(model)
        for name, param in model.named_parameters():
            assert param.dtype == torch.float64 and param.grad.dtype == torch.float64, f"{when}: {name}"
        _check_grads(model, reference, step_tolerance, when)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        _check_params(model, reference, step_tolerance, f"{when} after optimizer step")
        if step == 0:  # float64 from here: start from equal values, not fp32 round-off apart
            with unshard_params(model, writeback=False), torch.no_grad():
                for param, reference_param in zip(model.parameters(), reference.parameters()):
                    reference_param.copy_(param)
    for _, state in unit_states_under(model):
        for handle in state.handles:
            assert handle.sharded_flat_param.dtype == torch.float64
            assert handle.layout.dtype == torch.float64
    model_state = model.state_dict()
    assert all(value.dtype == torch.float64 for value in model_state.values())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model_state[name], value, **tolerance)


def _float64_right_after_sharding_matches_reference(strategy: ShardingStrategy, rank: int, world_size: int) -> None:
    """FSDP2's cast-after-init scenario: the cast (swapping tensors) right
    after fully_shard, before lazy init, then Adam with foreach."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model).double()
    _shard(strategy, None)(model)
    _to_float64_swapping(model)
    assert all(param.dtype == torch.float64 for param in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=True)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    tolerance = dict(atol=1e-12, rtol=1e-12)
    for step in range(3):
        inputs, targets = batch(step)
        reference_loss = plain_step(reference, inputs, targets)
        loss = plain_step(model, inputs[local], targets[local])
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world_size, reference_loss, **tolerance)
        _check_grads(model, reference, tolerance, f"step {step}")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        _check_params(model, reference, tolerance, f"step {step} after optimizer step")


def _float64_casts(rank: int, world_size: int) -> None:
    run_subtests(
        {"strategy": STRATEGIES}, _float64_right_after_sharding_matches_reference, rank=rank, world_size=world_size
    )
    run_subtests(
        {"strategy": STRATEGIES, "cast": tuple(_casts())},
        _float64_after_cast_matches_reference,
        rank=rank,
        world_size=world_size,
    )


@world_sizes
def test_float64_cast_after_sharding_trains_in_parity(world_size: int) -> None:
    run_distributed(_float64_casts, world_size)


def _low_precision_casts(rank: int, world_size: int) -> None:
    """``.half()`` and ``.bfloat16()`` after sharding: shards, compute and
    gradients follow; with a mixed-precision ``param_dtype`` the compute
    dtype stays the policy's while the shards take the new dtype."""
    for cast, dtype, mixed_precision, compute in (
        (nn.Module.half, torch.float16, None, torch.float16),
        (nn.Module.bfloat16, torch.bfloat16, None, torch.bfloat16),
        (nn.Module.double, torch.float64, MixedPrecision(param_dtype=torch.float32), torch.float32),
    ):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        _shard(ShardingStrategy.FULL_SHARD, mixed_precision)(model)
        cast(model)
        cast(reference)
        inputs, targets = batch(0)
        local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        logits = model(inputs[local])
        assert logits.dtype == compute, (dtype, logits.dtype)
        lm_loss(logits.float(), targets[local]).backward()
        for name, param in model.named_parameters():
            assert param.dtype == dtype and param.grad.dtype == dtype, (name, param.dtype, param.grad.dtype)
        for _, state in unit_states_under(model):
            for handle in state.handles:
                assert handle.sharded_flat_param.dtype == dtype and handle.param_dtype == compute
        reference_loss = lm_loss(reference(inputs).float(), targets)
        loss = lm_loss(logits.float(), targets[local]).detach()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world_size, reference_loss, atol=2e-2, rtol=2e-2)


def _policy_dtypes_survive_a_cast(rank: int, world_size: int) -> None:
    """FSDP2's clamp-reduce-dtype scenario: a bf16 model under a bf16
    compute and reduction policy, cast to fp32 after sharding, keeps
    computing and reducing in bf16 while its shards and gradients are fp32."""
    torch.manual_seed(0)
    model = TinyGPT().bfloat16()
    _shard(ShardingStrategy.FULL_SHARD, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))(model)
    model.to(torch.float32)
    inputs, targets = batch(0)
    spy = CollectiveSpy()
    with spy.watching():
        logits = model(inputs)
        lm_loss(logits.float(), targets).backward()
    assert logits.dtype == torch.bfloat16
    reduced = {dtype for _, dtype in spy.reductions_issued("reduce_scatter")}
    assert reduced == {torch.bfloat16}, reduced
    assert spy.dtypes("all_gather_into") == {torch.bfloat16}, spy.dtypes("all_gather_into")
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, (name, param.dtype, param.grad.dtype)


def _low_precision_and_policy_casts(rank: int, world_size: int) -> None:
    _low_precision_casts(rank, world_size)
    _policy_dtypes_survive_a_cast(rank, world_size)


@pytest.mark.parametrize("world_size", [2])
def test_low_precision_cast_after_sharding_moves_shards_and_compute(world_size: int) -> None:
    run_distributed(_low_precision_and_policy_casts, world_size)


def _partial_cast_is_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard(ShardingStrategy.FULL_SHARD, None)(model)
    inputs, targets = batch(0)
    model.blocks[1].fc_in.double()
    with pytest.raises(ValueError, match=r"fully_shard.*'blocks\.1\.fc_in\.weight'.*float64.*float32.*cast"):
        model(inputs)
    model.blocks[1].fc_in.float()  # usable once cast back
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    loss = plain_step(model, inputs[local], targets[local])
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world_size, plain_step(reference, inputs, targets))
    _check_grads(model, reference, dict(atol=2e-6, rtol=2e-5), "after casting back")
    assert get_state(model.blocks[1]).handles[0].sharded_flat_param.dtype == torch.float32  # type: ignore[union-attr]


def test_cast_of_part_of_a_flat_parameter_is_refused_at_the_next_forward() -> None:
    run_distributed(_partial_cast_is_refused, 2)


def _replaced_between_forward_and_backward(rank: int, world_size: int) -> None:
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        shard_manually(strategy)(model)
        original = model.blocks[1].fc_in.weight
        inputs, targets = batch(0)
        loss = lm_loss(model(inputs[local]), targets[local])
        model.blocks[1].fc_in.weight = nn.Parameter(torch.full((48, 16), 0.5))
        with pytest.raises(RuntimeError, match=r"parameter \['fc_in\.weight'\] was replaced by another object during a step.*original was registered back"):
            loss.backward()
        # Nothing of the replacement stayed: the original is back and the
        # model trains like the reference from its untouched values.
        assert model.blocks[1].fc_in.weight is original, strategy
        sgd_steps_in_parity(model, reference, range(1, 3), strategy.name)


def test_a_parameter_replaced_between_forward_and_backward_is_refused() -> None:
    run_distributed(_replaced_between_forward_and_backward, 2)
