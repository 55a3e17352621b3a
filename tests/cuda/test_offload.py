"""CUDA: the lane-fence race and fast CPU offload, against single-device
references, step by step. Skipped where no GPU is present.

The race (see [Note: lane fences] in composable_shard/scheduler.py): when a
unit's shard group has one rank (world size 1, or ``NO_SHARD``) and its
unsharded buffer is its own allocation (mixed precision or CPU offload),
``unshard`` fills the buffer with copies on the all-gather stream and no
collective. Unfenced, compute read the buffer before the copies ran. The
models here are large enough (tens of MiB per unit, a handful of tokens)
that the copies take milliseconds while compute takes microseconds, so an
unfenced copy gives wrong losses (or NaN) from the first step.

Offload (see [Note: CPU offload copies] in composable_shard/handle/grads.py):
pinned uploads cast on the device, pinned non-blocking gradient downloads
with one host wait at the end of backward, and the optimizer stepping on CPU
on the offloaded shards, with mixed precision, ``no_sync``, gradient
accumulation across backwards, ``clip_grad_norm_`` and state dicts.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictOptions,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    unshard_params,
)
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import requires_cuda, requires_gpus, run_distributed
from tests.support.mixed_precision import cast_all
from tests.support.models import Block, TinyGPT, batch, big_gpt, lm_loss
from tests.support.offload import accumulate_and_clip, cuda_device
from tests.support.parity import Parity, assert_resharded, compare_full, run_parity

OFFLOAD = CPUOffload(offload_params=True)
BF16 = torch.bfloat16
FP32 = torch.float32
FULL = StateDictOptions(full_state_dict=True)

def _shard_by_blocks(model: nn.Module, **kwargs: object) -> None:
    fully_shard(model, policy={Block}, **kwargs)


# ------------------------------------------------------------ fp32 offload
def _offloaded_fp32_matches_reference(rank: int, world_size: int, strategy: ShardingStrategy) -> None:
    shard = functools.partial(_shard_by_blocks, strategy=strategy, cpu_offload=OFFLOAD)
    losses = run_parity(Parity(build=big_gpt, shard=shard, device=cuda_device(rank), steps=4))
    assert all(torch.isfinite(torch.tensor(losses))), losses


@requires_cuda
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_offloaded_model_at_shard_size_one_matches_reference_every_step(strategy: ShardingStrategy) -> None:
    """Before the fence, every unshard here was an unfenced upload."""
    run_distributed(_offloaded_fp32_matches_reference, 1, strategy, backend="nccl")


@requires_gpus(2)
def test_offloaded_no_shard_model_on_two_gpus_matches_reference_every_step() -> None:
    run_distributed(_offloaded_fp32_matches_reference, 2, ShardingStrategy.NO_SHARD, backend="nccl")


# ----------------------------------------------------- bf16 (and offload)
def _fp32_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs).float(), targets)
    loss.backward()
    return loss.detach()


def _low_precision_parity(rank: int, world_size: int, strategy: ShardingStrategy, offload: bool) -> None:
    """bf16 compute with fp32 master weights and reduction, against the
    low-precision data-parallel reference of tests/support/mixed_precision.py
    ([Note: the low-precision reference]) run on the same GPU: the
    reference's fp32 master weights are set to the sharded model's before
    each step, each rank's slice of the batch runs on a bf16 copy of them,
    and the slices' fp32 gradients are averaged. At shard size 1 both run the
    same bf16 kernels on the same values, so the tolerances are fp32
    round-off."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    master = copy.deepcopy(model)
    policy = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    _shard_by_blocks(model, strategy=strategy, mixed_precision=policy, cpu_offload=OFFLOAD if offload else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    case = f"{strategy.name}, offload={offload}"
    per_rank = 8 // world_size
    for step in range(4):
        when = f"{case}, step {step}"
        with unshard_params(model, writeback=False), torch.no_grad():
            for param, master_param in zip(model.parameters(), master.parameters()):
                master_param.copy_(param)
        inputs, targets = (t.to(device) for t in batch(step))
        reference_loss = torch.zeros((), device=device)
        reference_grads = {name: torch.zeros_like(p) for name, p in master.named_parameters()}
        for r in range(world_size):
            compute = cast_all(master, BF16)
            local = slice(r * per_rank, (r + 1) * per_rank)
            reference_loss += _fp32_loss(compute, inputs[local], targets[local])
            for name, param in compute.named_parameters():
                reference_grads[name] += param.grad.float()
        reference_loss /= world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = _fp32_loss(model, inputs[local], targets[local])
        dist.all_reduce(loss)
        loss /= world_size
        assert torch.isfinite(loss), f"{when}: loss {loss.item()}"
        torch.testing.assert_close(loss, reference_loss, atol=2e-6, rtol=2e-6, msg=lambda m: f"{when}, loss: {m}")
        assert_resharded(model)
        for name, param in model.named_parameters():
            assert param.dtype == FP32, f"{when}: {name} is {param.dtype}"
            if offload:
                assert param.device.type == "cpu" and param.grad is not None and param.grad.device.type == "cpu", name
        with unshard_params(model, with_grads=True, writeback=False):
            for name, param in model.named_parameters():
                expected = reference_grads[name] / world_size
                torch.testing.assert_close(
                    param.grad.float(), expected, atol=2e-6, rtol=2e-5, msg=lambda m: f"{when}, grad of {name}: {m}"
                )
        for name, master_param in master.named_parameters():
            master_param.grad = reference_grads[name] / world_size
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        with unshard_params(model, writeback=False):
            for (name, param), master_param in zip(model.named_parameters(), master.parameters()):
                torch.testing.assert_close(
                    param.detach(), master_param.detach(), atol=2e-6, rtol=2e-5, msg=lambda m: f"{when}, {name} after step: {m}"
                )


@requires_cuda
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_bf16_model_at_shard_size_one_matches_low_precision_reference(strategy: ShardingStrategy, offload: bool) -> None:
    """The issue's configuration (offload + bf16: NaN from the second step)
    and bf16 alone (a cast copy into the unit's own buffer, also unfenced)."""
    run_distributed(_low_precision_parity, 1, strategy, offload, backend="nccl")


@requires_gpus(2)
@pytest.mark.parametrize("offload", [True, False])
def test_bf16_no_shard_model_on_two_gpus_matches_low_precision_reference(offload: bool) -> None:
    run_distributed(_low_precision_parity, 2, ShardingStrategy.NO_SHARD, offload, backend="nccl")


# --------------------------------------------- accumulation and clipping
def _offload_accumulates_and_clips(rank: int, world_size: int, use_no_sync: bool) -> None:
    step = functools.partial(accumulate_and_clip, use_no_sync=use_no_sync)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        shard = functools.partial(_shard_by_blocks, strategy=strategy, cpu_offload=OFFLOAD)
        run_parity(
            Parity(
                build=big_gpt,
                shard=shard,
                device=cuda_device(rank),
                step_fn=step,
                reference_step_fn=step,
                make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
            )
        )


@requires_cuda
@pytest.mark.parametrize("use_no_sync", [True, False])
def test_offload_gradient_accumulation_and_clipping_match_reference(use_no_sync: bool) -> None:
    """Without no_sync the second backward adds its reduced gradient to the
    pinned host gradient of the first (uploaded, summed on the device,
    downloaded into the same memory)."""
    run_distributed(_offload_accumulates_and_clips, 1, use_no_sync, backend="nccl")


# ------------------------------------------------------------ state dicts
def _train(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, steps: range) -> None:
    for step in steps:
        inputs, targets = (t.to(device) for t in batch(step))
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def _offload_state_dicts_round_trip(rank: int, world_size: int) -> None:
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    reference = copy.deepcopy(model)
    _shard_by_blocks(model, cpu_offload=OFFLOAD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(model, optimizer, device, range(2))
    _train(reference, reference_optimizer, device, range(2))
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model_state[name].cpu(), value.cpu(), atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for name, param in reference.named_parameters():
        for key, value in reference_optimizer.state[param].items():
            torch.testing.assert_close(
                torch.as_tensor(optimizer_state["state"][name][key]).cpu().float(),
                torch.as_tensor(value).cpu().float(),
                atol=2e-6,
                rtol=1e-5,
                msg=lambda m: f"optimizer state {name}.{key}: {m}",
            )
    # A fresh offloaded model (other initial values) takes both and trains on
    # exactly like the reference.
    torch.manual_seed(1)
    restored = TinyGPT().to(device)
    _shard_by_blocks(restored, cpu_offload=OFFLOAD)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    set_model_state_dict(restored, model_state, options=FULL)
    set_optimizer_state_dict(restored, restored_optimizer, optimizer_state, options=FULL)
    for _, state in unit_states_under(restored):
        for handle in state.handles:
            assert handle.sharded_flat_param.device.type == "cpu" and handle.sharded_flat_param.is_pinned()
    for param in restored.parameters():
        for key, value in restored_optimizer.state[param].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device.type == "cpu", f"optimizer state {key} on {value.device}: the step runs on CPU"
    parity = Parity(build=TinyGPT, shard=_shard_by_blocks, device=device)
    for step in range(2, 4):
        inputs, targets = (t.to(device) for t in batch(step))
        loss = lm_loss(restored(inputs), targets)
        loss.backward()
        reference_loss = lm_loss(reference(inputs), targets)
        reference_loss.backward()
        torch.testing.assert_close(loss, reference_loss, atol=2e-6, rtol=1e-5)
        compare_full(restored, reference, parity, f"restored, step {step}", grads=True)
        restored_optimizer.step()
        reference_optimizer.step()
        restored_optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(restored, reference, parity, f"restored, step {step} after optimizer step", grads=False)


@requires_cuda
def test_offload_model_and_optimizer_state_dicts_round_trip_and_training_resumes() -> None:
    run_distributed(_offload_state_dicts_round_trip, 1, backend="nccl")
