"""The sharded checkpoint format uses nothing deprecated: saving and loading
(plain DCP with our state dicts, and the safe helpers) raise no
FutureWarning or DeprecationWarning (turned into errors here), no value is a
ShardedTensor, and ``RangeShardedTensor`` answers DCP's tensor protocol
consistently: every rank's boxes tile each parameter exactly once, a rank
holding no element has no boxes but still has the key, and the box DCP
reads or writes is a view of the model's own shard. The ShardedTensor
fallback (for a torch without the protocol) still round-trips, and its
checkpoints load with the protocol."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from composable_shard import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from composable_shard.state_dict import RangeShardedTensor

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, train_steps


def _leaves(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in _leaves(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in _leaves(value)]
    return [state]


def _sorted_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # Each parameter's state names sorted: a loaded optimizer's order follows the checkpoint.
    state = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    return {fqn: dict(sorted(values.items())) for fqn, values in state.items()}


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any], dict[str, Any]]:
    """A model sharded by hand after two AdamW steps, its full state (to
    compare with) and its sharded state dicts (to save)."""
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(2))
    expected = {"model": get_model_state_dict(model, options=FULL), "optim": _sorted_state(model, optimizer)}
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    return model, optimizer, expected, state


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Another model, sharded by policy, with other initial values."""
    torch.manual_seed(1)
    fresh = shard(BufferedGPT(), "policy")
    return fresh, make_optimizer("adamw", fresh)


def _fresh_from_dcp(path: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer loaded with plain ``dcp.load``."""
    fresh, fresh_optimizer = _fresh()
    destination = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(destination, checkpoint_id=path)
    set_model_state_dict(fresh, destination["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, destination["optim"])
    return fresh, fresh_optimizer


def _no_deprecated_parts(rank: int, world_size: int, root: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        model, optimizer, expected, state = _trained()
        tensors = [leaf for leaf in _leaves(state) if isinstance(leaf, torch.Tensor)]
        assert all(type(leaf) in (torch.Tensor, RangeShardedTensor) for leaf in tensors), {type(leaf) for leaf in tensors}
        assert sum(isinstance(leaf, RangeShardedTensor) for leaf in tensors) > 20
        dcp.save(state, checkpoint_id=f"{root}/raw")
        save_checkpoint(f"{root}/safe", model, optimizer, extra_state={"step": 2})

        # "raw" and "raw_safe_load": plain dcp.save read by dcp.load, and by load_checkpoint (no manifest:
        # into new buffers, after reading the optimizer's hyperparameters to check them).
        for source in ("raw", "raw_safe_load", "safe"):
            if source == "raw":
                fresh, fresh_optimizer = _fresh_from_dcp(f"{root}/raw")
            elif source == "raw_safe_load":
                fresh, fresh_optimizer = _fresh()
                assert load_checkpoint(f"{root}/raw", fresh, fresh_optimizer) == {}
            else:
                fresh, fresh_optimizer = _fresh()
                assert load_checkpoint(f"{root}/safe", fresh, fresh_optimizer) == {"step": 2}
            assert_same_tensors(get_model_state_dict(fresh, options=FULL), expected["model"], f"model from {source}")
            assert_same_tensors(_sorted_state(fresh, fresh_optimizer), expected["optim"], f"optimizer from {source}")
            train_steps(fresh, fresh_optimizer, range(2, 3))


@pytest.mark.parametrize("world_size", [2, 4])
def test_saving_and_loading_raise_no_deprecation_warning(world_size: int, tmp_path: Path) -> None:
    run_distributed(_no_deprecated_parts, world_size, str(tmp_path))


def _boxes_tile_every_parameter(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("sgd", model)
    train_steps(model, optimizer, range(1))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    flat = {f"model.{key}": value for key, value in state["model"].items()}
    flat.update({f"optim.{fqn}.{key}": value for fqn, values in state["optim"]["state"].items() for key, value in values.items()})
    sharded = {key: value for key, value in flat.items() if isinstance(value, RangeShardedTensor)}
    mine = {key: [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()] for key, value in sharded.items()}
    every = dist.get_world_size()
    gathered: list[Any] = [None] * every
    dist.all_gather_object(gathered, mine)
    assert all(sorted(rank_boxes) == sorted(mine) for rank_boxes in gathered)  # every rank has every key
    empty_somewhere = False
    for key, value in sharded.items():
        boxes = [box for rank_boxes in gathered for box in rank_boxes[key]]
        empty_somewhere |= any(not rank_boxes[key] for rank_boxes in gathered)
        assert sum(math.prod(sizes) for _, sizes in boxes) == value.numel(), key  # no overlap, no gap (with the next check)
        covered = torch.zeros(value.shape, dtype=torch.int32)
        for offsets, sizes in boxes:
            covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        assert bool((covered == 1).all()), key
        items = value.__create_write_items__(key, value)
        assert [(tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes)) for i in items] == mine[key]
        assert all(i.tensor_data.size == value.shape and i.tensor_data.properties.dtype == value.dtype for i in items)
        for offsets, sizes in mine[key]:
            box = value.__get_tensor_shard__(MetadataIndex(key, torch.Size(offsets)))
            assert box.shape == torch.Size(sizes)
            # The same memory as the shard (no copy), in a storage of exactly its bytes (DCP copies others).
            flat = sum(o * math.prod(value.shape[d + 1 :]) for d, o in enumerate(offsets))
            assert box.data_ptr() == value.local.data_ptr() + (flat - value.local_start) * value.element_size()
            assert box.untyped_storage().nbytes() == box.numel() * box.element_size()
    assert empty_somewhere or world_size < 4
    param = model.get_parameter("blocks.0.fc_in.weight")
    value = state["model"]["blocks.0.fc_in.weight"]
    assert value.local.numel() == 0 or value.local.data_ptr() == param.data_ptr()  # views of the model's shard
    with pytest.raises(RuntimeError, match="not supported on a RangeShardedTensor"):
        value + 1


@pytest.mark.parametrize("world_size", [1, 4])
def test_range_sharded_tensor_boxes_tile_every_parameter_once(world_size: int) -> None:
    run_distributed(_boxes_tile_every_parameter, world_size)


def _legacy_fallback_round_trips(rank: int, world_size: int, root: str) -> None:
    """Checkpoints that hold a 0-dim parameter with shape (1,) (earlier
    versions, and the ShardedTensor fallback of torch releases before DCP's
    tensor protocol, both wrote them so; simulated here by giving the 0-dim
    parameter's sharding that shape), plain ``dcp.save`` or
    ``save_checkpoint``, load through ``load_checkpoint``."""
    import dataclasses

    import composable_shard.state_dict.entries as entries_module

    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(2))
    expected = {"model": get_model_state_dict(model, options=FULL), "optim": _sorted_state(model, optimizer)}
    real_range_sharding = entries_module.range_sharding

    def legacy_range_sharding(info: Any, *args: Any) -> Any:
        sharding = real_range_sharding(info, *args)
        return dataclasses.replace(sharding, shape=torch.Size([1])) if len(info.shape) == 0 else sharding

    entries_module.range_sharding = legacy_range_sharding  # type: ignore[assignment]
    try:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        assert state["model"]["temperature"].shape == (1,)
        dcp.save(state, checkpoint_id=f"{root}/legacy")
        save_checkpoint(f"{root}/legacy_safe", model, optimizer)
    finally:
        entries_module.range_sharding = real_range_sharding  # type: ignore[assignment]
    for source in ("legacy", "legacy_safe"):  # written with shape (1,), read into shape ()
        torch.manual_seed(1)
        fresh = shard(BufferedGPT(), "hybrid" if world_size == 4 else "policy")
        fresh_optimizer = make_optimizer("adamw", fresh)
        # Both through load_checkpoint: these checkpoints hold the 0-dim temperature
        # with shape (1,), which today's state dicts (shape ()) only take through
        # load_checkpoint's destinations (a plain dcp.load refuses the size).
        load_checkpoint(f"{root}/{source}", fresh, fresh_optimizer)
        assert_same_tensors(get_model_state_dict(fresh, options=FULL), expected["model"], f"{source} read into shape ()")
        assert_same_tensors(_sorted_state(fresh, fresh_optimizer), expected["optim"], f"{source} optimizer read into shape ()")


@pytest.mark.parametrize("world_size", [2])
def test_checkpoints_holding_scalars_with_shape_1_still_load(world_size: int, tmp_path: Path) -> None:
    run_distributed(_legacy_fallback_round_trips, world_size, str(tmp_path))


def _async_save_snapshot(rank: int, world_size: int, root: str) -> None:
    model, optimizer, expected, state = _trained()
    future = dcp.async_save(state, checkpoint_id=f"{root}/async")
    # Training on before the write finished changes every shard and state in
    # place: the checkpoint must still hold the values at the call.
    train_steps(model, optimizer, range(2, 3))
    future.result()
    after = get_model_state_dict(model, options=FULL)
    assert any(
        isinstance(value, torch.Tensor) and not torch.equal(value, expected["model"][fqn]) for fqn, value in after.items()
    ), "the step after the call changed nothing: the test would not see a checkpoint that aliases the shards"

    fresh, fresh_optimizer = _fresh_from_dcp(f"{root}/async")
    assert_same_tensors(get_model_state_dict(fresh, options=FULL), expected["model"], "model from async_save")
    assert_same_tensors(_sorted_state(fresh, fresh_optimizer), expected["optim"], "optimizer from async_save")


def test_async_save_writes_the_state_at_the_call_while_training_goes_on(tmp_path: Path) -> None:
    run_distributed(_async_save_snapshot, 2, str(tmp_path))
