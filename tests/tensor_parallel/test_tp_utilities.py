"""The utilities that read parameters over a 2 x 2 (dp, tp) mesh:
``unshard_params`` (full DTensors, with gradients and write-back) and the
plan and ``describe`` (local tensor-parallel shards counted)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from composable_shard import describe, fully_shard, plan, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.tensor_parallel import (
    build_stack,
    global_batch,
    local_loss,
    local_slice,
    mesh_2x2,
    parallelize,
    reference_loss,
)


def _unshard_params_shows_full_dtensors(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    reference = build_stack()
    model = parallelize(copy.deepcopy(reference), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, device_mesh=mesh["dp"])
    x = global_batch(0)
    reference_loss(reference(x)).backward()
    local_loss(model(local_slice(x, mesh)), x, mesh).backward()
    # Between steps: a DTensor whose local tensor is this rank's range.
    weight = model.blocks[0].up.weight
    assert isinstance(weight, DTensor) and weight.to_local().dim() == 1
    held = torch.tensor([weight.to_local().numel()])
    torch.distributed.all_reduce(held, group=mesh["dp"].get_group())
    assert held.item() == 16 * 8 // 2  # the dp ranks' ranges tile this tp rank's local tensor
    assert isinstance(weight.grad, DTensor) and weight.grad.to_local().shape == weight.to_local().shape
    with unshard_params(model, with_grads=True):
        for name, param in model.named_parameters():
            expected = reference.get_parameter(name)
            assert isinstance(param, DTensor) and param.shape == expected.shape, name
            assert param.placements == model.get_parameter(name).placements
            torch.testing.assert_close(param.full_tensor(), expected.detach(), atol=0, rtol=0)
            torch.testing.assert_close(param.grad.full_tensor(), expected.grad, atol=1e-6, rtol=1e-5)
        # In-place edits of the local tensors are written back to the shards.
        with torch.no_grad():
            model.blocks[1].down.weight.to_local().add_(1.0)
            model.blocks[0].norm.bias.to_local().mul_(3.0)
    with torch.no_grad():
        reference.blocks[1].down.weight.add_(1.0)
        reference.blocks[0].norm.bias.mul_(3.0)
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.full_tensor(), reference.get_parameter(name).detach(), atol=0, rtol=0)
    # And the next step trains from them.
    x = global_batch(1)
    ref_out, out = reference(x), model(local_slice(x, mesh))
    torch.testing.assert_close(out, local_slice(ref_out, mesh).detach(), atol=1e-6, rtol=1e-5)


def test_unshard_params_shows_full_dtensors_with_grads_and_writes_edits_back() -> None:
    run_distributed(_unshard_params_shows_full_dtensors, 4, timeout=300)


def _plan_counts_local_shards(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    model = parallelize(build_stack(), mesh["tp"])
    local_numel = sum(param.to_local().numel() for param in model.parameters())
    global_numel = sum(param.numel() for param in model.parameters())
    assert local_numel < global_numel  # the tp shards are smaller than the model
    dp_rank = mesh["dp"].get_local_rank()
    policy = {type(model.blocks[0])}
    planned = plan(model, world_size=2, rank=dp_rank, policy=policy)
    for block in model.blocks:
        fully_shard(block, device_mesh=mesh["dp"])
    described = describe(model)
    planned_units = {unit.name: unit for unit in planned.units}
    assert sum(unit.numel for unit in planned.units) == local_numel
    assert sum(unit.numel for unit in described.units) == local_numel
    for unit in described.units:
        got = [(fp.numel, fp.padded_numel, fp.shard_numel, fp.local_numel) for fp in unit.flat_params]
        want = [(fp.numel, fp.padded_numel, fp.shard_numel, fp.local_numel) for fp in planned_units[unit.name].flat_params]
        assert got == want, unit.name
    assert described.rank_bytes["params"] == planned.rank_bytes["params"]

    # The memory recorder reads DTensor gradients by their local tensors.
    from composable_shard.planning import MemoryRecorder

    fully_shard(model, device_mesh=mesh["dp"])
    x = global_batch(0)
    with MemoryRecorder().record() as record:
        local_loss(model(local_slice(x, mesh)), x, mesh).backward()
    assert all(isinstance(param.grad, DTensor) for param in model.parameters())
    peak_runtime_bytes = max(sample.runtime_bytes or 0 for sample in record.samples)
    assert peak_runtime_bytes >= planned.rank_bytes["params"] + planned.rank_bytes["grads"]


def _module_state_dict_round_trip(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    reference = build_stack()
    model = parallelize(copy.deepcopy(reference), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, device_mesh=mesh["dp"])
    fully_shard(model, device_mesh=mesh["dp"])
    # state_dict(): DTensors with their TP placements, as without fully_shard.
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, value in state.items():
        assert isinstance(value, DTensor), key
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[key], atol=0, rtol=0)
    # load_state_dict of DTensors (its own, scaled) and of plain full tensors.
    scaled = {key: value * 2 for key, value in state.items()}
    model.load_state_dict(scaled)
    with unshard_params(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.full_tensor(), 2 * reference.get_parameter(name).detach(), atol=0, rtol=0)
    model.load_state_dict(reference.state_dict())
    with unshard_params(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.full_tensor(), reference.get_parameter(name).detach(), atol=0, rtol=0)


def test_module_state_dict_gives_and_takes_tensor_parallel_dtensors() -> None:
    run_distributed(_module_state_dict_round_trip, 4, timeout=300)


def _sharded(reference: torch.nn.Module, mesh) -> torch.nn.Module:
    model = parallelize(copy.deepcopy(reference), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, device_mesh=mesh["dp"])
    fully_shard(model, device_mesh=mesh["dp"])
    return model


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, mesh=None) -> None:
    out = model(local_slice(x, mesh)) if mesh is not None else model(x)
    (local_loss(out, x, mesh) if mesh is not None else reference_loss(out)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state_dicts(rank: int, world_size: int) -> None:
    from composable_shard.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    mesh = mesh_2x2()
    reference = build_stack()
    model = _sharded(reference, mesh)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(reference, ref_opt, global_batch(0))
    _step(model, opt, global_batch(0), mesh)
    # Full state dicts: the global tensors (gathered over dp and tp).
    model_sd = get_model_state_dict(model, options=full)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model_sd[key], value, atol=2e-6, rtol=1e-5)
    optim_sd = get_optimizer_state_dict(model, opt, options=full)
    for name, param in reference.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim_sd["state"][name][key], ref_opt.state[param][key], atol=1e-6, rtol=1e-5)
    # Loaded into a fresh sharded model (full tensors; the model one by
    # rank 0's broadcast), the next step matches the reference's.
    fresh = _sharded(build_stack(blocks=2), mesh)
    with torch.no_grad():
        for param in fresh.parameters():
            param.to_local().zero_()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    set_model_state_dict(
        fresh, model_sd if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=full)
    _step(reference, ref_opt, global_batch(1))
    _step(fresh, fresh_opt, global_batch(1), mesh)
    with unshard_params(fresh):
        for name, param in fresh.named_parameters():
            torch.testing.assert_close(param.full_tensor(), reference.get_parameter(name).detach(), atol=1e-5, rtol=1e-5)
    # A plain (single-process) state dict of full tensors loads too.
    set_model_state_dict(fresh, build_stack().state_dict())
    with unshard_params(fresh):
        for name, param in fresh.named_parameters():
            torch.testing.assert_close(param.full_tensor(), build_stack().get_parameter(name).detach(), atol=0, rtol=0)


def test_full_model_and_optimizer_state_dicts_hold_global_tensors_and_load_back() -> None:
    run_distributed(_full_state_dicts, 4, timeout=300)


def test_plan_and_describe_count_the_local_tensor_parallel_shards() -> None:
    run_distributed(_plan_counts_local_shards, 4, timeout=300)
