"""ignored_states: ignored modules and parameters stay whole and untouched
(same objects, same values, no hooks, no unit), their gradients are the
local, unreduced ones, and a user who reduces them trains like the
reference; buffers are never sharded and are cast per ``buffer_dtype`` (not
those of ignored modules)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, clip_grad_norm_, fully_shard, is_fully_sharded, unshard_params
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch
from tests.support.parity import Parity, assert_resharded, compare_full, plain_step


def _ignored_states_stay_local(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    ignored_block, ignored_param = model.blocks[1], model.pos_emb
    ignored = {id(p): p for p in [*ignored_block.parameters(), ignored_param]}
    values_before = {id(p): p.detach().clone() for p in ignored.values()}
    hooks_before = (len(ignored_block._forward_pre_hooks), len(ignored_block._forward_hooks))
    fully_shard(model, policy={Block}, ignored_states=[ignored_block, ignored_param])

    # Untouched by fully_shard: same objects, full shapes, same values, no unit, no hooks.
    assert not is_fully_sharded(ignored_block) and is_fully_sharded(model.blocks[0]) and is_fully_sharded(model.blocks[2])
    assert (len(ignored_block._forward_pre_hooks), len(ignored_block._forward_hooks)) == hooks_before
    owned = {id(p) for _, state in unit_states_under(model) for h in state.handles for p in h.orig_params}
    assert not owned & set(ignored), "a unit owns an ignored parameter"
    for key, param in ignored.items():
        assert param.shape == values_before[key].shape and torch.equal(param, values_before[key])
    assert model.pos_emb is ignored_param and model.blocks[1].fc_in.weight is ignored[id(model.blocks[1].fc_in.weight)]

    # SGD: AdamW would amplify round-off of near-zero (clipped) gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    parity = Parity(build=TinyGPT, shard=lambda m: None)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    reference_names = {id(p): n for n, p in model.named_parameters()}
    for step in range(3):
        inputs, targets = batch(step)
        local_reference = copy.deepcopy(reference)  # this rank's slice alone, for the local gradients
        plain_step(local_reference, inputs[local], targets[local])
        plain_step(reference, inputs, targets)
        plain_step(model, inputs[local], targets[local])
        assert_resharded(model)
        local_grads = dict(local_reference.named_parameters())
        for key, param in ignored.items():
            name = reference_names[key]
            # The hooks never reduce them: the gradient of this rank's loss.
            torch.testing.assert_close(param.grad, local_grads[name].grad, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
            # The user reduces them (like DDP would).
            dist.all_reduce(param.grad)
            param.grad /= world_size
        compare_full(model, reference, parity, f"step {step}", grads=True)
        # clip_grad_norm_ counts the (now replicated) ignored gradients once.
        total = clip_grad_norm_(model, max_norm=0.5)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)
        # unshard_params leaves ignored parameters as they are.
        with unshard_params(model, writeback=False):
            for param in ignored.values():
                assert param.shape == values_before[id(param)].shape
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"step {step} after optimizer step", grads=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ignored_modules_and_parameters_stay_local_and_train_when_reduced(world_size: int) -> None:
    run_distributed(_ignored_states_stay_local, world_size)


class _Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.bn = nn.BatchNorm1d(16)
        self.ignored_bn = nn.BatchNorm1d(16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.block(x).transpose(1, 2)).transpose(1, 2) * self.scale
        return self.ignored_bn(x.float().transpose(1, 2)).transpose(1, 2)


def _buffers_never_sharded_and_cast(rank: int, world_size: int) -> None:
    for buffer_dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = _Buffered()
        buffers_before = {n: (b, b.clone()) for n, b in model.named_buffers()}
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=buffer_dtype) if buffer_dtype else None
        fully_shard(model, policy={Block}, mixed_precision=mixed_precision, ignored_states=[model.ignored_bn])
        for name, buffer in model.named_buffers():
            original, values = buffers_before[name]
            assert buffer is original and buffer.shape == values.shape, f"{name} was replaced or sharded"
            cast = buffer_dtype is not None and values.is_floating_point() and not name.startswith("ignored_bn")
            assert buffer.dtype == (buffer_dtype if cast else values.dtype), (name, buffer.dtype)
            torch.testing.assert_close(buffer.to(values.dtype), values, atol=1e-2, rtol=1e-2)
        expected_orig = {"bn.running_mean": torch.float32, "bn.running_var": torch.float32, "scale": torch.float32}
        assert get_state(model).buffer_dtypes_of(model) == (expected_orig if buffer_dtype else {})  # type: ignore[union-attr]
        # Training keeps them whole, in their dtype, on every rank alike.
        model(torch.randn(4, 3, 16)).sum().backward()
        for name, buffer in model.named_buffers():
            assert buffer.shape == buffers_before[name][1].shape


def test_buffers_are_never_sharded_and_cast_per_buffer_dtype() -> None:
    run_distributed(_buffers_never_sharded_and_cast, 2)


def _ignored_by_a_child_unit(rank: int, world_size: int) -> None:
    """What a unit's own call left out stays out of the units above it, as
    in FSDP1 (before: the parent's call refused those parameters as
    "registered inside an already sharded unit after that unit was
    sharded"), given as a module or as its parameters; a unit itself in
    ``ignored_states`` is refused by name, changing nothing."""
    for as_parameters in (False, True):
        torch.manual_seed(0)
        model = TinyGPT()
        ignored_module = model.blocks[1].fc_out
        ignored = list(ignored_module.parameters())
        fully_shard(model.blocks[1], ignored_states=ignored if as_parameters else [ignored_module])
        fully_shard(model.blocks[0])
        fully_shard(model)
        owned = {id(p) for _, state in unit_states_under(model) for h in state.handles for p in h.orig_params}
        assert not owned & {id(p) for p in ignored}, as_parameters
        assert all(p.shape == q.shape for p, q in zip(ignored, TinyGPT().blocks[1].fc_out.parameters()))
        inputs, _ = batch(0)
        model(inputs[:2]).sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in ignored)

    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model.blocks[0])
    with pytest.raises(ValueError, match=r"fully_shard\(TinyGPT\): ignored_states holds Block, which an earlier fully_shard call made a unit"):
        fully_shard(model, ignored_states=[model.blocks[0]])
    assert not is_fully_sharded(model)
    fully_shard(model)


def test_what_a_child_unit_ignored_stays_out_of_its_parent() -> None:
    run_distributed(_ignored_by_a_child_unit, 2)
