"""Initialisation of tensor-parallel (DTensor) models by ``fully_shard`` on a
2 x 2 (dp, tp) mesh of 4 gloo ranks: ``sync_module_states`` gives every
data-parallel rank its tensor-parallel slice's first rank's values, and a
model built on the meta device is materialised with the values its modules'
``reset_parameters`` give the parallelised model, placements kept.
FSDP2's counterpart is ``test_meta_device_2d_init``; the training parity
after meta initialisation is the "meta_init" case of test_tp_training.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composable_shard import fully_shard, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.tensor_parallel import TPStack, build_stack, mesh_2x2, parallelize

INIT_SEED = 7


def _local_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model):
        return {name: param.to_local().detach().clone() for name, param in model.named_parameters()}


def _shard(model: TPStack, **kwargs: Any) -> TPStack:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _synced(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank perturbs its local tensors by its rank before fully_shard
    with sync_module_states; returns what each parameter moved by."""
    mesh = mesh_2x2()
    model = parallelize(build_stack(), mesh["tp"])
    start = {name: param.to_local().detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().add_(float(rank))
    _shard(model, device_mesh=mesh["dp"], sync_module_states=True)
    first_dp_rank = int(mesh.mesh[0, mesh["tp"].get_local_rank()])
    moved = {name: value - start[name] for name, value in _local_values(model).items()}
    return {"first_dp_rank": first_dp_rank, "moved": moved}


def _meta_materialised(rank: int, world_size: int) -> dict[str, Any]:
    """The meta-built model after fully_shard against the eagerly built,
    parallelised model whose modules were reset in the documented order
    (unit by unit, pre-order) from the same seed."""
    mesh = mesh_2x2()
    with torch.device("meta"):
        meta = parallelize(TPStack(), mesh["tp"])
    assert all(param.is_meta for param in meta.parameters())
    torch.manual_seed(INIT_SEED)
    _shard(meta, device_mesh=mesh["dp"])

    eager = parallelize(build_stack(), mesh["tp"])
    torch.manual_seed(INIT_SEED)
    with torch.no_grad():
        for block in eager.blocks:
            for module in block.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    with unshard_params(meta):  # between steps a parameter is a 1-D range of its slice
        placements = {
            name: (param.placements == eager.get_parameter(name).placements, param.device.type)
            for name, param in meta.named_parameters()
            if isinstance(param, DTensor)
        }
    got = _local_values(meta)
    differs = {
        name: float((got[name] - param.to_local().detach()).abs().max()) for name, param in eager.named_parameters()
    }
    # A Replicate parameter must hold the same values on both tp ranks.
    replicated = {}
    for name, value in got.items():
        if all(p.is_replicate() for p in meta.get_parameter(name).placements):
            gathered = [torch.empty_like(value) for _ in range(mesh["tp"].size())]
            dist.all_gather(gathered, value, group=mesh["tp"].get_group())
            replicated[name] = all(torch.equal(gathered[0], other) for other in gathered)
    return {"placements": placements, "differs": differs, "replicated": replicated, "n_params": len(got)}


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    return {"synced": _synced(rank, world_size), "meta": _meta_materialised(rank, world_size)}


def test_sync_module_states_and_meta_init_over_tensor_parallel_params() -> None:
    results = run_distributed(_cases, 4, timeout=240)
    for rank, result in enumerate(results):
        synced = result["synced"]
        # Before the fix: DTensor refused the broadcast ("c10d.broadcast_
        # does not have a sharding strategy"); over the default group it
        # would also have copied tp rank 0's slices onto tp rank 1.
        for name, moved in synced["moved"].items():
            torch.testing.assert_close(
                moved, torch.full_like(moved, float(synced["first_dp_rank"])), msg=lambda m: f"rank {rank} {name}: {m}"
            )
        meta = result["meta"]
        assert meta["n_params"] == 12, meta
        assert meta["placements"] and all(
            same and device == "cpu" for same, device in meta["placements"].values()
        ), meta["placements"]
        assert all(value == 0.0 for value in meta["differs"].values()), (rank, meta["differs"])
        assert meta["replicated"] and all(meta["replicated"].values()), (rank, meta["replicated"])
    # The tp slices differ: rank 1 keeps its own +1, rank 3 takes rank 1's.
    assert [r["synced"]["first_dp_rank"] for r in results] == [0, 1, 0, 1]
