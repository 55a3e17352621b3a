"""Model state dicts of a sharded tree: full and sharded forms of
``get_model_state_dict`` / ``set_model_state_dict``, ``module.state_dict()`` /
``load_state_dict()`` through the state-dict hooks, strict key checking,
shape mismatches, buffers, and the sharded representation's boxes."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper

from composable_shard import (
    StateDictError,
    StateDictOptions,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    unshard_params,
)
from composable_shard.runtime.state import unit_states_under
from composable_shard.state_dict import RangeShardedTensor
from composable_shard.state_dict.shards import is_sharded_tensor, range_boxes

from tests.support.comm_spies import CommSpy
from tests.support.harness_pool import run_distributed, world_sizes
from tests.support.models import DIM, Block, BufferedGPT, LoRAGPT, TinyGPT, batch, lm_loss
from tests.support.state_dicts import FULL, FULL_RANK0, assert_same_tensors, full_params, perturbed, shard, train_steps

# -------------------------------------------------------- sharded boxes
def test_range_boxes_tile_the_range_in_flat_order() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        end = rng.randint(start, numel)
        flat = torch.arange(numel).reshape(shape) if shape else torch.tensor(0)
        boxes = range_boxes(shape, start, end)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        cursor = start
        for offsets, sizes, flat_start in boxes:
            assert flat_start == cursor
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            values = flat[index].reshape(-1)
            assert torch.equal(values, torch.arange(cursor, cursor + values.numel())), (shape, start, end)
            cursor += values.numel()
        assert cursor == end, (shape, start, end, boxes)


# ------------------------------------------------------- full state dicts
def _full_state_dicts(rank: int, world_size: int) -> None:
    hows = ["manual", "policy", "no_shard", "ignored", "mixed"] + (["hybrid"] if world_size > 1 else [])
    for how in hows:
        torch.manual_seed(0)
        reference = BufferedGPT()
        reference.counter.count = 7
        if how == "mixed":  # buffers live in bf16: values it holds exactly, given back in fp32
            reference.scale.copy_(torch.arange(DIM) / 8)
        model = shard(copy.deepcopy(reference), how)
        expected = reference.state_dict()
        assert "cache" not in expected and "head.weight" in expected and "counter._extra_state" in expected
        params_before = {name: id(p) for name, p in model.named_parameters()}

        # get_model_state_dict(full) and module.state_dict(): the unsharded model's keys, shapes, values.
        assert_same_tensors(get_model_state_dict(model, options=FULL), expected, f"{how} full")
        assert model.scale.dtype == (torch.bfloat16 if how == "mixed" else torch.float32)
        assert_same_tensors(model.state_dict(), expected, f"{how} state_dict()")
        with CommSpy() as spy:
            on_rank0 = get_model_state_dict(model, options=FULL_RANK0)
        # One all-gather per sharded flat parameter: one unit's full copy alive at a time.
        handles = sum(len(unit.handles) for _, unit in unit_states_under(model) if unit.groups.is_sharded)
        assert spy.calls == ["all_gather_into"] * handles, spy.calls
        if rank == 0:
            assert all(v.device.type == "cpu" for v in on_rank0.values() if isinstance(v, torch.Tensor))
            assert_same_tensors(on_rank0, expected, f"{how} full rank0")
        else:
            assert on_rank0 == {}

        # Loading full tensors writes each rank's range and keeps the parameters.
        changed = perturbed(expected, 1.0)
        changed["counter._extra_state"] = {"count": 9}
        model.load_state_dict(changed)
        assert {name: id(p) for name, p in model.named_parameters()} == params_before
        assert_same_tensors(get_model_state_dict(model, options=FULL), changed, f"{how} after load_state_dict")
        assert model.counter.count == 9
        set_model_state_dict(model, expected, options=FULL)
        assert_same_tensors(model.state_dict(), expected, f"{how} after set full")
        set_model_state_dict(model, changed if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        assert_same_tensors(model.state_dict(), changed, f"{how} after broadcast")
        model.load_state_dict(expected, assign=True)  # torch replaces ignored (unsharded) parameters
        after_assign = {name: id(p) for name, p in model.named_parameters() if not name.startswith("norm.")}
        assert after_assign == {k: v for k, v in params_before.items() if not k.startswith("norm.")}
        assert_same_tensors(model.state_dict(), expected, f"{how} after assign")

        # Still trains, and the loaded values are what it trains from (ignored
        # parameters' gradients are not averaged, so no reference for them).
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), range(1))
        if how in ("ignored", "mixed"):
            continue
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        inputs, targets = batch(0)
        lm_loss(reference(inputs), targets).backward()
        ref_opt.step()
        assert_same_tensors(full_params(model), dict(reference.named_parameters()), f"{how} trained", atol=2e-6)


@world_sizes
def test_full_state_dict_has_the_unsharded_models_keys_and_loads_into_shards(world_size: int) -> None:
    run_distributed(_full_state_dicts, world_size)


def _load_errors_change_nothing(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    good = get_model_state_dict(model, options=FULL)
    before = copy.deepcopy(good)

    wrong_keys = perturbed(good, 1.0)
    del wrong_keys["blocks.1.fc_in.weight"], wrong_keys["scale"]
    wrong_keys["blocks.9.fc_in.weight"] = torch.zeros(3)
    with pytest.raises(StateDictError, match=r"Missing key\(s\) in state_dict: 'scale', 'blocks.1.fc_in.weight'\.") as info:
        set_model_state_dict(model, wrong_keys, options=FULL)
    assert "Unexpected key(s) in state_dict: 'blocks.9.fc_in.weight'" in str(info.value)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    assert_same_tensors(get_model_state_dict(model, options=FULL), before, "after key error")

    wrong_shape = perturbed(good, 1.0)
    wrong_shape["blocks.2.fc_out.weight"] = torch.zeros(DIM, 7)
    with pytest.raises(StateDictError, match=r"'blocks.2.fc_out.weight': shape \(16, 7\) does not match the model's \(16, 48\)"):
        set_model_state_dict(model, wrong_shape, options=FULL)
    with pytest.raises(StateDictError, match="blocks.2.fc_out.weight"):
        set_model_state_dict(model, wrong_shape if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_same_tensors(get_model_state_dict(model, options=FULL), before, "after shape error")

    # strict=False loads what fits and reports the rest; shapes are still checked.
    partial = perturbed(good, 2.0)
    del partial["pos_emb"]
    partial["extra.weight"] = torch.zeros(1)
    result = set_model_state_dict(model, partial, options=StateDictOptions(full_state_dict=True, strict=False))
    assert result.missing_keys == ["pos_emb"] and result.unexpected_keys == ["extra.weight"]
    expected = dict(partial)
    del expected["extra.weight"]
    expected["pos_emb"] = before["pos_emb"]
    assert_same_tensors(get_model_state_dict(model, options=FULL), {k: expected[k] for k in before}, "after strict=False")

    # module.load_state_dict reports like torch, with the unsharded shapes.
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.2.fc_out.weight: copying a param with shape \(16, 7\) from checkpoint, the shape in current model is \(16, 48\)"):
        model.load_state_dict(wrong_shape)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "scale", "blocks.1.fc_in.weight"'):
        model.load_state_dict(wrong_keys)
    with pytest.raises(TypeError, match="StateDictOptions"):
        get_model_state_dict(model, options={"full_state_dict": True})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="inside unshard_params"):
        with unshard_params(model):
            get_model_state_dict(model)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), range(1))


@world_sizes
def test_load_errors_name_the_keys_and_change_nothing(world_size: int) -> None:
    run_distributed(_load_errors_change_nothing, world_size)


# ---------------------------------------------------- sharded state dicts
def _sharded_round_trip(rank: int, world_size: int, root: str) -> None:
    hows = ["manual", "policy", "no_shard", "ignored"] + (["hybrid"] if world_size > 1 else [])
    for how in hows:
        torch.manual_seed(0)
        reference = BufferedGPT()
        expected = reference.state_dict()
        model = shard(copy.deepcopy(reference), how)
        with CommSpy() as spy:
            sharded = get_model_state_dict(model)
        assert spy.calls == [], f"sharded get_model_state_dict ran collectives {spy.calls}"
        assert list(sharded) == list(expected)
        for key, value in sharded.items():
            if key in ("scale", "counter._extra_state") or key.endswith("seen") or (how == "ignored" and key.startswith("norm.")):
                assert not is_sharded_tensor(value), key
            else:
                assert isinstance(value, RangeShardedTensor) and value.shape == expected[key].shape, key
        path = f"{root}/{how}"
        dcp.save(sharded, checkpoint_id=path)

        model.load_state_dict(perturbed(expected, 1.0))  # something else, then load the checkpoint back
        destination = get_model_state_dict(model)
        dcp.load(destination, checkpoint_id=path)
        set_model_state_dict(model, destination)
        assert_same_tensors(get_model_state_dict(model, options=FULL), expected, f"{how} sharded round trip")

        # A sharded state dict of the other layout loads as well (full tensors accepted too).
        set_model_state_dict(model, perturbed(expected, 3.0))
        assert_same_tensors(model.state_dict(), perturbed(expected, 3.0), f"{how} sharded set from full")


@world_sizes
def test_sharded_state_dict_round_trips_through_dcp_without_collectives(world_size: int, tmp_path: Path) -> None:
    run_distributed(_sharded_round_trip, world_size, str(tmp_path))


def _frozen_parameters_can_be_left_out(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = LoRAGPT()
    model = shard(copy.deepcopy(reference), "manual")
    frozen = {name for name, p in reference.named_parameters() if not p.requires_grad}
    assert frozen
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    trainable = get_model_state_dict(model, options=options)
    assert frozen.isdisjoint(trainable) and "blocks.0.proj.lora_a" in trainable
    result = set_model_state_dict(model, perturbed(trainable, 1.0), options=options)
    assert result.missing_keys == [] and result.unexpected_keys == []
    expected = {k: v + 1.0 if k in trainable else v for k, v in reference.state_dict().items()}
    assert_same_tensors(model.state_dict(), expected, "after loading the trainable parameters only")
    with pytest.raises(StateDictError, match=r"Missing key\(s\) in state_dict: 'blocks.0.proj.base.weight'"):
        set_model_state_dict(model, trainable, options=FULL)


def test_frozen_parameters_can_be_left_out_of_state_dicts() -> None:
    run_distributed(_frozen_parameters_can_be_left_out, 2)


def _wrap_blocks_then_shard(model: torch.nn.Module) -> None:

    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
        fully_shard(model.blocks[index])
    fully_shard(model)


def _shard_then_apply_checkpointing(model: torch.nn.Module) -> None:
    fully_shard(model.blocks[0])
    fully_shard(model)  # blocks 1 and 2 are the root's
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))


def _checkpoint_wrapped_state_dicts(rank: int, world_size: int) -> None:
    def wrap_whole_model(model: torch.nn.Module) -> torch.nn.Module:
        wrapped = checkpoint_wrapper(model)
        fully_shard(wrapped)
        return wrapped

    layouts = {
        "fully_shard(checkpoint_wrapper(block))": lambda m: (_wrap_blocks_then_shard(m), m)[1],
        "fully_shard(checkpoint_wrapper(model))": wrap_whole_model,
        "apply_activation_checkpointing after fully_shard": lambda m: (_shard_then_apply_checkpointing(m), m)[1],
    }
    for name, wrap in layouts.items():
        torch.manual_seed(0)
        reference = TinyGPT()
        model = wrap(copy.deepcopy(reference))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        train_steps(model, optimizer, range(2))
        for step in range(2):
            inputs, targets = batch(step)
            lm_loss(reference(inputs), targets).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        # The plain model's keys and full values, every way of asking.
        expected = reference.state_dict()
        assert_same_tensors(model.state_dict(), expected, f"{name}: module.state_dict()", atol=1e-5)
        assert_same_tensors(get_model_state_dict(model, options=FULL), expected, f"{name}: get_model_state_dict", atol=1e-5)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
        assert sorted(optimizer_state) == sorted(dict(reference.named_parameters())), f"{name}: {sorted(optimizer_state)}"
        # A plain model's state dict loads both ways.
        torch.manual_seed(1)
        fresh = TinyGPT().state_dict()
        set_model_state_dict(model, fresh, options=FULL)
        assert_same_tensors(get_model_state_dict(model, options=FULL), fresh, f"{name}: after set_model_state_dict")
        model.load_state_dict(expected)
        assert_same_tensors(model.state_dict(), expected, f"{name}: after load_state_dict", atol=1e-5)


def test_state_dicts_under_checkpoint_wrappers_have_the_plain_models_keys() -> None:
    run_distributed(_checkpoint_wrapped_state_dicts, 2)


class _SharedSubmodule(torch.nn.Module):
    """One submodule reachable by two names (FSDP1's
    test_shared_module_and_shared_parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.net2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.net3 = self.net2
        self.weight = torch.nn.Parameter(torch.randn(10))
        self.alias = self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net3(self.net2(self.net1(x))) + self.weight.sum()


def _shared_submodule_loads(rank: int, world_size: int) -> None:
    """``load_state_dict`` of a plain state dict into a model whose
    submodule goes by two names (torch visits it under both): each value
    sliced once (before: the second name's slice was cut from the first's
    and loading raised a size mismatch)."""
    for policy in (None, {torch.nn.Sequential}):
        torch.manual_seed(0)
        expected = _SharedSubmodule().state_dict()
        torch.manual_seed(1)
        model = _SharedSubmodule()
        fully_shard(model, policy=policy)
        model.load_state_dict(expected)
        assert_same_tensors(model.state_dict(), expected, f"policy={policy}: after load_state_dict")
        assert_same_tensors(get_model_state_dict(model, options=FULL), expected, f"policy={policy}: full")


def test_load_state_dict_into_a_submodule_with_two_names() -> None:
    run_distributed(_shared_submodule_loads, 2)
