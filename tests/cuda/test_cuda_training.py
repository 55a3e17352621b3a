"""The CUDA paths (NCCL, all-gather and reduce-scatter streams, events,
mixed precision on the device): parity against the single-process
reference. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from composable_shard import BackwardPrefetch, MixedPrecision, ShardingStrategy, fully_shard

from tests.support.harness_pool import requires_cuda, requires_gpus, run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, run_parity


def _cuda_parity(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    for kwargs in (
        dict(strategy=ShardingStrategy.FULL_SHARD),
        dict(strategy=ShardingStrategy.SHARD_GRAD_OP),
        dict(strategy=ShardingStrategy.NO_SHARD),
        dict(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_POST),
        dict(limit_all_gathers=False),
    ):

        def shard(model: nn.Module, kwargs: dict = kwargs) -> None:
            for block in model.blocks:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)

        run_parity(Parity(build=TinyGPT, shard=shard, device=device))
    # No unsharded memory may stay allocated between steps.
    torch.cuda.synchronize(device)


@requires_cuda
def test_cuda_training_matches_reference_on_one_gpu() -> None:
    run_distributed(_cuda_parity, 1, backend="nccl")


@requires_gpus(2)
@pytest.mark.parametrize("world_size", [2])
def test_cuda_training_matches_reference_on_two_gpus(world_size: int) -> None:
    run_distributed(_cuda_parity, world_size, backend="nccl")


def _cuda_mixed_precision_runs(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mixed_precision=policy)
    fully_shard(model, mixed_precision=policy)
    idx = torch.randint(0, 32, (4, 6), device=device)
    loss = model(idx).float().square().mean()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
        if param.grad is not None:
            assert param.grad.dtype == torch.float32 and torch.isfinite(param.grad).all(), name


@requires_cuda
def test_cuda_mixed_precision_keeps_fp32_master_weights_and_grads() -> None:
    run_distributed(_cuda_mixed_precision_runs, 1, backend="nccl")
