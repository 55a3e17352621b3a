"""Training parity of ``fully_shard`` over tensor-parallel (DTensor) models on
a 2 x 2 (dp, tp) mesh of 4 gloo ranks against a single-process reference on
the global batch, step by step (tests/support/tensor_parallel.py), and the
refusals of what a flat parameter cannot hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module

from composable_shard import MixedPrecision, ShardingStrategy, fully_shard, is_fully_sharded

from tests.support.harness_pool import run_distributed
from tests.support.tensor_parallel import (
    TPBlock,
    TPParity,
    block_plan,
    build_stack,
    mesh_2x2,
    parallelize,
    run_tp_parity,
)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fp32_cases(rank: int, world_size: int) -> dict[str, list[float]]:
    mesh = mesh_2x2()
    dp = dict(device_mesh=mesh["dp"])
    cases = {
        "full_shard": TPParity(shard_kwargs=dp),
        # The 2-D mesh itself: its "dp" dimension is the one sharded.
        "shard_grad_op_2d_mesh": TPParity(shard_kwargs=dict(device_mesh=mesh, strategy=ShardingStrategy.SHARD_GRAD_OP)),
        "checkpointed": TPParity(shard_kwargs=dp, checkpointed=True),
        "checkpointed_shard_grad_op": TPParity(
            shard_kwargs=dict(dp, strategy=ShardingStrategy.SHARD_GRAD_OP), checkpointed=True
        ),
        # A Shard(0) weight and a Replicate bias frozen.
        "frozen_tp_params": TPParity(shard_kwargs=dp, frozen=("blocks.0.up.weight", "blocks.1.down.bias")),
        "no_sync": TPParity(shard_kwargs=dp, micro_batches=2),
        "adamw_foreach": TPParity(
            shard_kwargs=dp, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)
        ),
        # clip_grad_norm_ (ours) equals torch's on the reference, every step;
        # max_norm below the norm, so the gradients are really scaled.
        "clip_grad_norm": TPParity(shard_kwargs=dp, clip=0.05),
        "clip_grad_norm_frozen": TPParity(shard_kwargs=dp, clip=0.05, frozen=("blocks.1.norm.weight",)),
        "torch_clip_grad_norm": TPParity(shard_kwargs=dp, clip=0.05, torch_clip=True),
        # Built on the meta device: fully_shard materialises the DTensor
        # parameters with reset_parameters (tests/tensor_parallel/test_tp_init.py
        # checks the values); the reference starts from them.
        "meta_init": TPParity(shard_kwargs=dp, meta_init=True),
        "adamw_fused": TPParity(
            shard_kwargs=dp, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)
        ),
    }
    return {name: run_tp_parity(case, mesh) for name, case in cases.items()}


def test_fully_shard_over_tensor_parallel_blocks_matches_single_process() -> None:
    losses = run_distributed(_fp32_cases, 4, timeout=600)
    assert all(rank_losses == losses[0] for rank_losses in losses)  # every rank saw the same global loss


def _bf16_cases(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        for checkpointed in (False, True):
            run_tp_parity(
                TPParity(
                    shard_kwargs=dict(device_mesh=mesh["dp"], strategy=strategy, mixed_precision=bf16),
                    checkpointed=checkpointed,
                    compute_dtype=torch.bfloat16,
                    make_optimizer=_sgd,
                    atol=2e-2,
                    rtol=2e-2,
                ),
                mesh,
            )


def test_bf16_mixed_precision_over_tensor_parallel_blocks_matches_low_precision_reference() -> None:
    run_distributed(_bf16_cases, 4, timeout=600)


def _hybrid_over_a_3d_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    # HYBRID over (replicate, shard, tp): gradients reduce-scattered over
    # "shard", all-reduced over "replicate", never over "tp".
    for shape in ((2, 1, 2), (1, 2, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
            run_tp_parity(TPParity(shard_kwargs=dict(device_mesh=mesh, strategy=strategy), clip=0.05), mesh)


def test_hybrid_sharding_over_a_replicate_shard_tp_mesh_matches_single_process() -> None:
    run_distributed(_hybrid_over_a_3d_mesh, 4, timeout=600)


def _refusals(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh_2x2()
    messages = []
    # Sharding over every rank: the data-parallel group overlaps the tp mesh.
    model = parallelize(build_stack(), mesh["tp"])
    block = model.blocks[0]
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' is a DTensor on a mesh .* shares ranks") as caught:
        fully_shard(block)
    messages.append(str(caught.value))
    assert not is_fully_sharded(block) and block.up.weight.shape == (16, 8)  # left as it was
    # The model stays usable: sharding on the dp dimension works afterwards.
    fully_shard(block, device_mesh=mesh["dp"])
    # Refused before any unit is built: a policy whose first unit is plain.
    model = build_stack()
    parallelize_module(model.blocks[1], mesh["tp"], block_plan())
    with pytest.raises(ValueError, match=r"parameter '(blocks.1.)?norm.weight' is a DTensor"):
        fully_shard(model, policy={TPBlock})
    assert not any(is_fully_sharded(m) for m in model.modules())
    # keep_low_precision_grads with DTensor parameters: refused before any
    # unit is built (a policy whose first unit, the plain block 0, would
    # otherwise be sharded already), naming the parameter.
    model = build_stack()
    parallelize_module(model.blocks[1], mesh["tp"], block_plan())
    keep_low = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    with pytest.raises(ValueError, match=r"parameter '(blocks.1.)?norm.weight' is a DTensor .*keep_low_precision_grads"):
        fully_shard(model, policy={TPBlock}, device_mesh=mesh["dp"], mixed_precision=keep_low)
    assert not any(is_fully_sharded(m) for m in model.modules())
    fully_shard(model, policy={TPBlock}, device_mesh=mesh["dp"])  # usable: without it, sharding works
    # A 3-D mesh with a "tp" dimension gives its other two (hybrid) dims.
    from composable_shard.units.tensor_parallel import data_parallel_mesh

    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    assert data_parallel_mesh(cube).mesh_dim_names == ("replicate", "shard")
    assert data_parallel_mesh(mesh).mesh_dim_names == ("dp",)
    return messages


def test_sharding_over_the_tensor_parallel_ranks_is_refused_naming_the_parameter() -> None:
    run_distributed(_refusals, 4, timeout=300)
