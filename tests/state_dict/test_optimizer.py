"""Optimizer state dicts of a sharded tree: the format of
``torch.distributed.checkpoint.state_dict`` (state keyed by parameter name,
param groups listing names), full state equal to a single-process
reference's, full / rank-0 broadcast / sharded (through DCP) round trips into
fresh optimizers that then train exactly like the uninterrupted run, and
errors that change nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from composable_shard import (
    StateDictError,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from composable_shard.state_dict.shards import is_sharded_tensor

from tests.support.comm_spies import CommSpy
from tests.support.harness_pool import run_distributed, world_sizes
from tests.support.models import BufferedGPT, batch, lm_loss
from tests.support.state_dicts import (
    FULL,
    FULL_RANK0,
    assert_same_tensors,
    decays,
    full_params,
    make_optimizer,
    shard,
    train_steps,
)


def _reference_after(kind: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A single process trained on the global batches (same init: seed 0)."""
    torch.manual_seed(0)
    reference = BufferedGPT()
    optimizer = make_optimizer(kind, reference)
    for step in range(steps):
        inputs, targets = batch(step)
        lm_loss(reference(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference, optimizer


def _named_reference_state(reference: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    names = {id(p): name for name, p in reference.named_parameters()}
    return {names[id(p)]: dict(state) for p, state in optimizer.state.items()}


def _trained(how: str, kind: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), how)
    optimizer = make_optimizer(kind, model)
    train_steps(model, optimizer, range(steps))
    return model, optimizer


def _fresh(how: str, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)  # other initial values: everything must come from the loaded state
    model = shard(BufferedGPT(), how)
    return model, make_optimizer(kind, model)


def _assert_resumes_identically(original: tuple[nn.Module, torch.optim.Optimizer], restored: tuple[nn.Module, torch.optim.Optimizer], what: str) -> None:
    """Both train the same further steps and end bitwise equal."""
    for model, optimizer in (original, restored):
        train_steps(model, optimizer, range(2, 4))
    assert_same_tensors(full_params(restored[0]), full_params(original[0]), what)


def _optimizer_round_trips(rank: int, world_size: int, root: str) -> None:
    hows = ["manual"] + (["hybrid"] if world_size > 1 else ["no_shard"])
    for how in hows:
        for kind in ("adamw", "sgd"):
            model, optimizer = _trained(how, kind, 2)
            reference, reference_optimizer = _reference_after(kind, 2)

            # Full: the single-process optimizer's state, by parameter name.
            full = get_optimizer_state_dict(model, optimizer, options=FULL)
            names = [name for name, _ in model.named_parameters()]
            grouped = [n for n in names if decays(n)] + [n for n in names if not decays(n)]
            assert [fqn for group in full["param_groups"] for fqn in group["params"]] == (grouped if kind == "adamw" else names)
            assert full["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]
            expected = _named_reference_state(reference, reference_optimizer)
            assert sorted(full["state"]) == sorted(expected), (sorted(full["state"]), sorted(expected))
            for fqn, values in expected.items():
                assert_same_tensors(full["state"][fqn], values, f"{how} {kind} state {fqn}", atol=2e-6)
            on_rank0 = get_optimizer_state_dict(model, optimizer, options=FULL_RANK0)
            assert (on_rank0 != {}) == (rank == 0)

            # Full round trip into a fresh optimizer (no state yet), and the rank-0 broadcast form.
            model_full = get_model_state_dict(model, options=FULL)
            for options in (FULL, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)):
                restored = _fresh(how, kind)
                is_source = rank == 0 or not options.broadcast_from_rank0
                set_model_state_dict(restored[0], model_full if is_source else {}, options=options)
                set_optimizer_state_dict(*restored, full if is_source else {}, options=options)
                assert_same_tensors(
                    get_optimizer_state_dict(*restored, options=FULL)["state"], full["state"], f"{how} {kind} reloaded"
                )

            # Sharded: saved with DCP as it is, loaded at the same world size
            # into a fresh model and optimizer, then training goes on exactly.
            with CommSpy() as spy:
                sharded = get_optimizer_state_dict(model, optimizer)
            assert spy.calls == []
            per_element = [v for values in sharded["state"].values() for k, v in values.items() if k != "step"]
            assert per_element and all(is_sharded_tensor(v) or v.dim() == 0 for v in per_element)
            path = f"{root}/{how}-{kind}"
            dcp.save({"model": get_model_state_dict(model), "optim": sharded}, checkpoint_id=path)
            restored = _fresh(how, kind)
            assert not restored[1].state
            destination = {"model": get_model_state_dict(restored[0]), "optim": get_optimizer_state_dict(*restored)}
            dcp.load(destination, checkpoint_id=path)
            set_model_state_dict(restored[0], destination["model"])
            set_optimizer_state_dict(*restored, destination["optim"])
            _assert_resumes_identically((model, optimizer), restored, f"{how} {kind} sharded resume")


@world_sizes
def test_optimizer_state_dict_round_trips_full_and_sharded(world_size: int, tmp_path: Path) -> None:
    run_distributed(_optimizer_round_trips, world_size, str(tmp_path))


def _optimizer_errors_change_nothing(rank: int, world_size: int) -> None:
    model, optimizer = _trained("manual", "adamw", 1)
    full = get_optimizer_state_dict(model, optimizer, options=FULL)
    before = copy.deepcopy(full)

    foreign = copy.deepcopy(full)
    foreign["state"]["blocks.7.fc_in.weight"] = foreign["state"].pop("blocks.0.fc_in.weight")
    with pytest.raises(StateDictError, match=r"Unexpected key\(s\) in state_dict: 'blocks.7.fc_in.weight'"):
        set_optimizer_state_dict(model, optimizer, foreign, options=FULL)

    misshaped = copy.deepcopy(full)
    misshaped["state"]["blocks.1.fc_out.weight"]["exp_avg"] = torch.zeros(3, 3)
    misshaped["param_groups"][0]["lr"] = 123.0
    with pytest.raises(StateDictError, match=r"'blocks.1.fc_out.weight.exp_avg': shape \(3, 3\) does not match"):
        set_optimizer_state_dict(model, optimizer, misshaped, options=FULL)
    with pytest.raises(StateDictError, match="blocks.1.fc_out.weight.exp_avg"):
        set_optimizer_state_dict(model, optimizer, misshaped if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with pytest.raises(StateDictError, match="expected a dict with 'state'"):
        set_optimizer_state_dict(model, optimizer, {"state": {}}, options=FULL)

    after = get_optimizer_state_dict(model, optimizer, options=FULL)
    assert after["param_groups"] == before["param_groups"]
    for fqn, values in before["state"].items():
        assert_same_tensors(after["state"][fqn], values, f"unchanged {fqn}")

    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of this module"):
        get_optimizer_state_dict(model, torch.optim.SGD(other.parameters(), lr=0.1))
    train_steps(model, optimizer, range(1, 2))


@world_sizes
def test_optimizer_load_errors_name_the_keys_and_change_nothing(world_size: int) -> None:
    run_distributed(_optimizer_errors_change_nothing, world_size)


def test_state_dict_package_holds_all_four_functions() -> None:
    import composable_shard
    from composable_shard.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        load_checkpoint,
        save_checkpoint,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    assert get_optimizer_state_dict is composable_shard.get_optimizer_state_dict
    assert set_optimizer_state_dict is composable_shard.set_optimizer_state_dict
    assert get_model_state_dict is composable_shard.get_model_state_dict
    assert set_model_state_dict is composable_shard.set_model_state_dict
    assert save_checkpoint is composable_shard.save_checkpoint and load_checkpoint is composable_shard.load_checkpoint


def _broadcast_into_other_orders(rank: int, world_size: int) -> None:
    """``broadcast_from_rank0`` pairs its broadcasts by name: an optimizer
    built over the parameters in another order on each rank loads rank 0's
    state exactly (before: the broadcasts paired by each rank's own order,
    gloo aborted on a size mismatch, and same-sized tensors would have gone
    to the wrong parameters); rank 0's dict is copied, not aliased; a rank
    whose optimizer lacks a parameter rank 0 sends raises, naming it, and
    so does gathering a full state dict over such optimizers, on every rank
    (FSDP1's test_full_optim_state_dict_nested_invalid)."""
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def build(seed: int, order: int, drop_last: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = shard(BufferedGPT(), "manual")
        params = list(model.parameters())[:: 1 if order == 0 else -1]
        return model, torch.optim.AdamW(params[:-1] if drop_last else params, lr=1e-2)

    original = build(0, order=0)
    train_steps(*original, range(2))
    model_full = get_model_state_dict(original[0], options=FULL)
    optimizer_full = get_optimizer_state_dict(*original, options=FULL)
    steps_before = {fqn: copy.deepcopy(values["step"]) for fqn, values in optimizer_full["state"].items()}
    restored = build(1, order=rank % 2)
    set_model_state_dict(restored[0], model_full if rank == 0 else {}, options=broadcast)
    set_optimizer_state_dict(*restored, optimizer_full if rank == 0 else {}, options=broadcast)
    reloaded = get_optimizer_state_dict(*restored, options=FULL)["state"]
    assert_same_tensors(dict(sorted(reloaded.items())), dict(sorted(optimizer_full["state"].items())), "reloaded")
    _assert_resumes_identically(original, restored, "resumed after a broadcast into another order")
    for fqn, step in steps_before.items():  # the caller's dict did not step with the optimizer
        assert torch.equal(torch.as_tensor(optimizer_full["state"][fqn]["step"]), torch.as_tensor(step)), fqn

    lacking = build(1, order=0, drop_last=rank == 1)
    if rank == 1:
        with pytest.raises(StateDictError, match=r"rank 0's optimizer state holds \['[\w.]+'\], which this rank's optimizer does not step"):
            set_optimizer_state_dict(*lacking, {}, options=broadcast)
        assert not lacking[1].state
    else:
        set_optimizer_state_dict(*lacking, optimizer_full, options=broadcast)
    # Gathering state the ranks do not all hold raises on every rank (before: zeros for the missing range).
    with pytest.raises(StateDictError, match=r"the optimizers of some ranks do not step \['[\w.]+'\], which others do"):
        get_optimizer_state_dict(*lacking, options=FULL)


def test_broadcast_from_rank0_loads_into_optimizers_of_another_parameter_order() -> None:
    run_distributed(_broadcast_into_other_orders, 2)
