"""CPU offload: on a CPU-only machine ``CPUOffload(offload_params=True)`` is
a valid no-op (training matches the reference for every strategy, composed
with no_sync and clip_grad_norm_); with a GPU, shards and sharded gradients
live on CPU (pinned) between uses, the optimizer steps on CPU and training
matches a reference on the GPU (skipped without one). Larger offloaded
models, mixed precision, accumulation and state dicts on the GPU:
tests/cuda/test_offload.py."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from composable_shard import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    fully_shard,
)
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import requires_cuda, run_distributed
from tests.support.models import Block, TinyGPT, lm_loss
from tests.support.offload import accumulate_and_clip
from tests.support.parity import Parity, plain_step, run_parity

OFFLOAD = CPUOffload(offload_params=True)


def _shard(strategy: ShardingStrategy, **kwargs: object):
    def shard(model: nn.Module) -> None:
        fully_shard(model, policy={Block}, strategy=strategy, cpu_offload=OFFLOAD, **kwargs)

    return shard


def _offload_on_cpu_is_a_no_op(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        run_parity(Parity(build=TinyGPT, shard=_shard(strategy)))
    run_parity(
        Parity(
            build=TinyGPT,
            shard=_shard(ShardingStrategy.FULL_SHARD),
            step_fn=accumulate_and_clip,
            reference_step_fn=accumulate_and_clip,
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
        )
    )
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    for _, state in unit_states_under(model):
        assert state.config.offload_params is False  # nothing to offload to on a CPU-only run
        assert all(not handle.offload_params for handle in state.handles)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_offload_on_cpu_is_a_no_op_that_trains_like_the_reference(world_size: int) -> None:
    run_distributed(_offload_on_cpu_is_a_no_op, world_size)


# ------------------------------------------------------------------ CUDA
def _offload_to_cpu_from_gpu(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    seen_in_forward: list[torch.device] = []

    def check_devices(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = plain_step(model, inputs, targets)
        assert seen_in_forward and all(d == device for d in seen_in_forward), seen_in_forward
        seen_in_forward.clear()
        for name, param in model.named_parameters():
            assert param.device.type == "cpu", f"{name} is on {param.device} between steps"
            if param.grad is not None:
                assert param.grad.device.type == "cpu", f"grad of {name} is on {param.grad.device}"
        for _, state in unit_states_under(model):
            for handle in state.handles:
                assert handle.sharded_flat_param.is_pinned()
                assert handle.unsharded_storage_bytes() == 0
        return loss

    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):

        def shard(model: nn.Module, strategy: ShardingStrategy = strategy) -> None:
            fully_shard(model, policy={Block}, strategy=strategy, cpu_offload=OFFLOAD)
            model.blocks[0].fc_in.register_forward_pre_hook(lambda m, args: seen_in_forward.append(m.weight.device))

        run_parity(Parity(build=TinyGPT, shard=shard, device=device, step_fn=check_devices))
    # Composed with no_sync and clipping (the optimizer steps on CPU).
    run_parity(
        Parity(
            build=TinyGPT,
            shard=_shard(ShardingStrategy.FULL_SHARD),
            device=device,
            step_fn=accumulate_and_clip,
            reference_step_fn=accumulate_and_clip,
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
        )
    )
    # Mixed precision: the bf16 copy is made on the device, the fp32 master stays on CPU.
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    idx = torch.randint(0, 32, (4, 6), device=device)
    lm_loss(model(idx).float(), idx).backward()
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and param.dtype == torch.float32, name
        if param.grad is not None:
            assert param.grad.device.type == "cpu" and param.grad.dtype == torch.float32, name


@requires_cuda
def test_cpu_offload_keeps_shards_and_grads_on_cpu_and_matches_a_gpu_reference() -> None:
    run_distributed(_offload_to_cpu_from_gpu, 1, backend="nccl")
