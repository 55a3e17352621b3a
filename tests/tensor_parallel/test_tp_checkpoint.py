"""Checkpoints of tensor-parallel models sharded with ``fully_shard``: state
dicts hold the global tensors' boxes, so a DCP checkpoint saved at (dp=2,
tp=2) loads at (dp=4, tp=1), (dp=1, tp=2) and into a single process,
optimizer state included, and interchanges both ways with FSDP2 + the same
TP plan (which also trains to the same parameters) and with HYBRID_SHARD over
a (replicate, shard, tp) mesh."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from composable_shard import ShardingStrategy, fully_shard
from composable_shard.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tests.support.harness_pool import run_distributed
from tests.support.tensor_parallel import (
    build_stack,
    full_params,
    global_batch,
    local_loss,
    local_slice,
    parallelize,
)

FULL = StateDictOptions(full_state_dict=True)


def _ours(dp: int, tp: int, replicate: int = 0):
    """(dp, tp) with FULL_SHARD; with ``replicate``, HYBRID_SHARD over a
    (replicate, shard = dp, tp) mesh."""
    if replicate:
        mesh = init_device_mesh("cpu", (replicate, dp, tp), mesh_dim_names=("replicate", "shard", "tp"))
        kwargs = dict(device_mesh=mesh, strategy=ShardingStrategy.HYBRID_SHARD)
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        kwargs = dict(device_mesh=mesh["dp"])
    model = parallelize(build_stack(), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, mesh


def _fsdp2(dp: int, tp: int):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(build_stack(), mesh["tp"])
    for block in model.blocks:
        fsdp2_fully_shard(block, mesh=mesh["dp"])
    fsdp2_fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh, step: int) -> None:
    x = global_batch(step)
    local_loss(model(local_slice(x, mesh)), x, mesh).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_fsdp2_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}


def _state_dicts(model, optimizer, fsdp2: bool):
    if fsdp2:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def _load(model, optimizer, path: str, fsdp2: bool) -> None:
    state = _state_dicts(model, optimizer, fsdp2)
    dcp.load(state, checkpoint_id=path)
    if fsdp2:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _save_at_2x2(rank: int, world_size: int, path: str, fsdp2: bool, replicate: int = 0) -> dict[str, torch.Tensor]:
    """Train one step at (2, 2) — or at (replicate, 1, 2) hybrid — save;
    return the global parameters after it and after a second step (what
    every layout must reproduce)."""
    if fsdp2:
        model, mesh = _fsdp2(2, 2)
    else:
        model, mesh = _ours(2 // max(replicate, 1), 2, replicate)
    optimizer = _adamw(model)
    _train_step(model, optimizer, mesh, 0)
    dcp.save(_state_dicts(model, optimizer, fsdp2), checkpoint_id=path)
    saved = _full_fsdp2_params(model) if fsdp2 else full_params(model)
    _train_step(model, optimizer, mesh, 1)
    after = _full_fsdp2_params(model) if fsdp2 else full_params(model)
    return {**{f"saved.{k}": v for k, v in saved.items()}, **{f"after.{k}": v for k, v in after.items()}}


def _load_and_step(
    rank: int, world_size: int, path: str, dp: int, tp: int, fsdp2: bool, replicate: int = 0
) -> dict[str, torch.Tensor]:
    model, mesh = _fsdp2(dp, tp) if fsdp2 else _ours(dp, tp, replicate)
    optimizer = _adamw(model)
    _load(model, optimizer, path, fsdp2)
    loaded = _full_fsdp2_params(model) if fsdp2 else full_params(model)
    _train_step(model, optimizer, mesh, 1)
    after = _full_fsdp2_params(model) if fsdp2 else full_params(model)
    return {**{f"saved.{k}": v for k, v in loaded.items()}, **{f"after.{k}": v for k, v in after.items()}}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=2e-6, rtol=1e-5, msg=lambda m: f"{what} {key}: {m}")


def test_checkpoint_saved_at_2x2_reshards_to_every_layout_with_optimizer_state(tmp_path: Path) -> None:
    path = str(tmp_path / "ours")
    want = run_distributed(_save_at_2x2, 4, path, False, timeout=300)[0]
    _assert_same(run_distributed(_load_and_step, 4, path, 4, 1, False, timeout=300)[0], want, "(4, 1)")
    _assert_same(run_distributed(_load_and_step, 2, path, 1, 2, False, timeout=300)[0], want, "(1, 2)")
    # A single process without a process group: DCP reads the global boxes
    # into plain full tensors (parameters and AdamW's exp_avg).
    reference = build_stack()
    state = {"model": reference.state_dict()}
    dcp.load(state, checkpoint_id=path)
    for name, value in state["model"].items():
        torch.testing.assert_close(value, want[f"saved.{name}"], atol=0, rtol=0)


def _train_both(rank: int, world_size: int) -> None:
    """Ours and FSDP2 over the same TP plan train to the same parameters."""
    ours, mesh = _ours(2, 2)
    theirs, _ = _fsdp2(2, 2)
    opt_ours, opt_theirs = _adamw(ours), _adamw(theirs)
    for step in range(3):
        _train_step(ours, opt_ours, mesh, step)
        _train_step(theirs, opt_theirs, mesh, step)
        _assert_same(full_params(ours), _full_fsdp2_params(theirs), f"step {step}")


def test_same_model_under_fsdp2_and_tensor_parallel_trains_to_the_same_parameters() -> None:
    run_distributed(_train_both, 4, timeout=300)


def test_checkpoints_interchange_with_fsdp2_both_ways(tmp_path: Path) -> None:
    ours_path, theirs_path = str(tmp_path / "ours"), str(tmp_path / "fsdp2")
    want_ours = run_distributed(_save_at_2x2, 4, ours_path, False, timeout=300)[0]
    want_theirs = run_distributed(_save_at_2x2, 4, theirs_path, True, timeout=300)[0]
    # FSDP2 loads ours and continues as we would; we load FSDP2's likewise.
    _assert_same(run_distributed(_load_and_step, 4, ours_path, 2, 2, True, timeout=300)[0], want_ours, "fsdp2<-ours")
    _assert_same(run_distributed(_load_and_step, 4, theirs_path, 2, 2, False, timeout=300)[0], want_theirs, "ours<-fsdp2")


def test_hybrid_sharded_tensor_parallel_checkpoints_reshard_both_ways(tmp_path: Path) -> None:
    """FSDP2's test_hsdp_tp_state_dict_save_load: HYBRID_SHARD over a
    (replicate, shard, tp) mesh saves and loads, optimizer state included,
    from and to the plain (dp, tp) layout."""
    plain, hybrid = str(tmp_path / "plain"), str(tmp_path / "hybrid")
    want_plain = run_distributed(_save_at_2x2, 4, plain, False, timeout=300)[0]
    for replicate, shard in ((2, 1), (1, 2)):
        got = run_distributed(_load_and_step, 4, plain, shard, 2, False, replicate, timeout=300)[0]
        _assert_same(got, want_plain, f"hybrid ({replicate}, {shard}, 2) <- (2, 2)")
    want_hybrid = run_distributed(_save_at_2x2, 4, hybrid, False, 2, timeout=300)[0]
    _assert_same(run_distributed(_load_and_step, 4, hybrid, 2, 2, False, timeout=300)[0], want_hybrid, "(2, 2) <- hybrid")
