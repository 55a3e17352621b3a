"""The flat step ([Note: the flat step] in composable_shard/optim/flat_step.py):
torch's elementwise optimizers step each run of a unit's parameters that lie
back to back in its shard as one tensor. Each test trains two copies of a
model side by side on every rank, one stepped flat and one per parameter
(``COMPOSABLE_SHARD_FLAT_STEP=0`` around its step), and requires bitwise
equal parameters and optimizer state after every step; the flat copy also
matches one process on the global batch."""

from __future__ import annotations

import contextlib
import copy
import io
import os
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, get_optimizer_state_dict, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import StepSlack, shard_manually

ATOL, RTOL = 2e-6, 1e-5
ENV = "COMPOSABLE_SHARD_FLAT_STEP"

# Every elementwise torch.optim class, with options that give it state of the
# parameter's shape (what the flat step joins and splits).
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "Adam fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "SGD nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "RMSprop centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, initial_accumulator_value=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1.0),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
}


@contextlib.contextmanager
def _per_parameter() -> Iterator[None]:
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def _backward(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    inputs, targets = batch(step, global_batch=8)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    lm_loss(model(inputs[local]), targets[local]).backward()


def _assert_same(flat: nn.Module, flat_optimizer: torch.optim.Optimizer, per_param: nn.Module,
                 per_param_optimizer: torch.optim.Optimizer, when: str) -> None:
    """Bitwise equal local parameters and optimizer state, in the same format."""
    for (name, a), b in zip(flat.named_parameters(), per_param.parameters()):
        assert torch.equal(a, b), f"{when}: parameter {name} differs"
        state_a, state_b = flat_optimizer.state.get(a, {}), per_param_optimizer.state.get(b, {})
        assert list(state_a) == list(state_b), f"{when}: {name} state keys {list(state_a)} != {list(state_b)}"
        for key, value in state_a.items():
            other = state_b[key]
            if isinstance(value, torch.Tensor):
                assert value.shape == other.shape and value.dtype == other.dtype, f"{when}: {name} {key} format"
                assert torch.equal(value, other), f"{when}: {name} state {key} differs"
            else:
                assert value == other, f"{when}: {name} state {key} differs"


def _runs_share_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> bool:
    """Whether two parameters of one run hold views of one state tensor (the
    flat step ran for them)."""
    first, second = (optimizer.state[p] for p in params)
    key = next(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() == 1)
    return first[key].untyped_storage().data_ptr() == second[key].untyped_storage().data_ptr()


def _every_optimizer_bitwise(rank: int, world_size: int, strategy_name: str) -> None:
    strategy = ShardingStrategy[strategy_name]
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        reference = TinyGPT()
        flat, per_param = copy.deepcopy(reference), copy.deepcopy(reference)
        shard_manually(strategy)(flat)
        shard_manually(strategy)(per_param)
        flat_optimizer, per_param_optimizer = make(flat.parameters()), make(per_param.parameters())
        reference_optimizer = make(reference.parameters())
        # The closing comparison with one process allows what adaptive steps
        # amplify of the gradients' round-off ([Note: parity after an
        # adaptive step] in tests/support/parity.py); the full gradients are
        # read from the per-parameter copy (bitwise the flat one's), so the
        # flat copy's own gradients stay as the runtime left them.
        slack = StepSlack()
        for step in range(3):
            _backward(flat, step, rank, world_size)
            _backward(per_param, step, rank, world_size)
            inputs, targets = batch(step, global_batch=8)
            lm_loss(reference(inputs), targets).backward()
            with unshard_params(per_param, writeback=False, with_grads=True):
                for pname, param in per_param.named_parameters():
                    slack.record_grad(pname, param.grad, reference.get_parameter(pname).grad)
            flat_optimizer.step()
            with _per_parameter():
                per_param_optimizer.step()
            flat_optimizer.zero_grad()
            per_param_optimizer.zero_grad()
            reference_optimizer.step()
            slack.account_steps(reference, reference_optimizer)
            reference_optimizer.zero_grad()
            _assert_same(flat, flat_optimizer, per_param, per_param_optimizer, f"{name}, {strategy_name}, step {step}")
        # The first block's layer norm weight and bias lie back to back (and
        # this rank holds both under NO_SHARD and on rank 0 when sharded).
        norm = [flat.blocks[0].norm.weight, flat.blocks[0].norm.bias]
        if all(p.numel() for p in norm):
            assert _runs_share_state(flat_optimizer, norm), f"{name}: the flat step did not run"
            per_param_norm = [per_param.blocks[0].norm.weight, per_param.blocks[0].norm.bias]
            assert not _runs_share_state(per_param_optimizer, per_param_norm)
        expected = dict(reference.named_parameters())
        with unshard_params(flat, writeback=False):
            for pname, param in flat.named_parameters():
                slack.assert_param_close(pname, param, expected[pname], atol=ATOL, rtol=RTOL, when=f"{name}, {strategy_name}")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_every_elementwise_optimizer_steps_flat_bitwise_as_per_parameter(strategy: str) -> None:
    run_distributed(_every_optimizer_bitwise, 2, strategy)


def _decay_groups(m: nn.Module, **more: Any) -> list[dict[str, Any]]:
    """Weight decay for the matrices only: the groups interleave within every
    block's layout (``more``: extra options of the second group)."""
    named = list(m.named_parameters())
    decayed = [p for n, p in named if "weight" in n and "norm" not in n]
    chosen = {id(p) for p in decayed}
    return [
        {"params": decayed, "weight_decay": 0.1},
        {"params": [p for _, p in named if id(p) not in chosen], "weight_decay": 0.0, **more},
    ]


# Groups whose runs span both groups (AdamW differing in weight decay alone)
# and groups stepped apart (another lr, or SGD).
GROUP_CASES: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], bool, dict[str, Any]]] = {
    "AdamW, decay groups": (lambda groups: torch.optim.AdamW(groups, lr=1e-2), True, {}),
    "AdamW, decay groups (an int 0), foreach": (
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True), True, {"weight_decay": 0}
    ),
    "AdamW, another lr": (lambda groups: torch.optim.AdamW(groups, lr=1e-2), False, {"lr": 3e-3}),
    "SGD, decay groups": (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9), False, {}),
}


def _groups_and_user_changes(rank: int, world_size: int) -> list[str]:
    checked = []
    for case, (make, spans_groups, more) in GROUP_CASES.items():
        torch.manual_seed(0)
        model = TinyGPT()
        flat, per_param = copy.deepcopy(model), copy.deepcopy(model)
        shard_manually(ShardingStrategy.FULL_SHARD)(flat)
        shard_manually(ShardingStrategy.FULL_SHARD)(per_param)
        flat_optimizer = make(_decay_groups(flat, **more))
        per_param_optimizer = make(_decay_groups(per_param, **more))
        for step in range(4):
            for m in (flat, per_param):
                _backward(m, step, rank, world_size)
                block = m.blocks[1]
                if step == 1:  # the user replaces one gradient: its run is stepped per parameter
                    block.norm.bias.grad = block.norm.bias.grad.clone()
                if step == 2:  # and clears one: not stepped at all, as in one process
                    block.norm.weight.grad = None
            flat_optimizer.step()
            with _per_parameter():
                per_param_optimizer.step()
            assert len(flat_optimizer.param_groups) == 2  # the step's own group is gone
            _assert_same(flat, flat_optimizer, per_param, per_param_optimizer, f"{case}, step {step}")
            flat_optimizer.zero_grad()
            per_param_optimizer.zero_grad()
        block = flat.blocks[0]
        norm, linear = [block.norm.weight, block.norm.bias], [block.fc_in.weight, block.fc_in.bias]
        if all(p.numel() for p in norm):
            assert _runs_share_state(flat_optimizer, norm), case
        if all(p.numel() for p in linear):  # a weight and a bias of different groups
            assert _runs_share_state(flat_optimizer, linear) == spans_groups, case
            checked.append(case)
    return checked


def test_parameter_groups_and_gradients_the_user_changed() -> None:
    checked = run_distributed(_groups_and_user_changes, 2)
    assert set().union(*checked) == set(GROUP_CASES)  # some rank holds both of a weight and its bias


def _state_dicts(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    models = [copy.deepcopy(model) for _ in range(4)]
    for m in models:
        shard_manually(ShardingStrategy.FULL_SHARD)(m)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    flat, per_param = (models[0], optimizers[0]), (models[1], optimizers[1])
    for step in range(2):
        for (m, o), off in ((flat, False), (per_param, True)):
            _backward(m, step, rank, world_size)
            with _per_parameter() if off else contextlib.nullcontext():
                o.step()
            o.zero_grad()
    # The same state dicts: torch's format and composable_shard's (by name).
    saved_flat, saved_per_param = flat[1].state_dict(), per_param[1].state_dict()
    assert saved_flat["param_groups"] == saved_per_param["param_groups"]
    assert sorted(saved_flat["state"]) == sorted(saved_per_param["state"])  # insertion order aside
    for index, state in saved_flat["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved_per_param["state"][index][key]), (index, key)
    by_name_flat = get_optimizer_state_dict(flat[0], flat[1])
    by_name_per_param = get_optimizer_state_dict(per_param[0], per_param[1])
    assert by_name_flat["state"].keys() == by_name_per_param["state"].keys()
    for name, state in by_name_flat["state"].items():
        for key, value in state.items():
            other = by_name_per_param["state"][name][key]
            local, other_local = getattr(value, "local", value), getattr(other, "local", other)  # a rank's part
            assert torch.equal(local, other_local), (name, key)
    # Loaded through torch.save into fresh optimizers (each parameter its own
    # tensors again: the flat step joins them), training goes on bitwise alike.
    buffer = io.BytesIO()
    torch.save(saved_flat, buffer)
    for m, o in zip(models[2:], optimizers[2:]):
        with torch.no_grad():  # the same shards: each parameter's local part
            for target, source in zip(m.parameters(), flat[0].parameters()):
                target.copy_(source)
        buffer.seek(0)
        o.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(2, 4):
        for index, (m, o) in enumerate(zip(models, optimizers)):
            _backward(m, step, rank, world_size)
            with _per_parameter() if index % 2 else contextlib.nullcontext():
                o.step()
            o.zero_grad()
        _assert_same(models[0], optimizers[0], models[1], optimizers[1], f"continued, step {step}")
        _assert_same(models[2], optimizers[2], models[3], optimizers[3], f"loaded, step {step}")
        _assert_same(models[0], optimizers[0], models[2], optimizers[2], f"loaded against kept, step {step}")


def test_state_dicts_are_those_of_per_parameter_stepping_and_load_back() -> None:
    run_distributed(_state_dicts, 2)


def _falls_back(rank: int, world_size: int) -> None:
    for case in ("closure", "step hook"):
        torch.manual_seed(0)
        model = TinyGPT()
        flat, per_param = copy.deepcopy(model), copy.deepcopy(model)
        shard_manually(ShardingStrategy.FULL_SHARD)(flat)
        shard_manually(ShardingStrategy.FULL_SHARD)(per_param)
        flat_optimizer = torch.optim.Adam(flat.parameters(), lr=1e-2)
        per_param_optimizer = torch.optim.Adam(per_param.parameters(), lr=1e-2)
        seen: list[int] = []
        if case == "step hook":  # a hook of the optimizer's own sees its parameters
            flat_optimizer.register_step_pre_hook(lambda o, a, k: seen.append(len(o.param_groups[0]["params"])))
        for step in range(2):
            for m, o, off in ((flat, flat_optimizer, False), (per_param, per_param_optimizer, True)):
                if case == "closure":
                    def closure(m: nn.Module = m) -> None:
                        _backward(m, step, rank, world_size)
                    with _per_parameter() if off else contextlib.nullcontext():
                        o.step(closure)
                else:
                    _backward(m, step, rank, world_size)
                    with _per_parameter() if off else contextlib.nullcontext():
                        o.step()
                o.zero_grad()
            _assert_same(flat, flat_optimizer, per_param, per_param_optimizer, f"{case}, step {step}")
        norm = [flat.blocks[0].norm.weight, flat.blocks[0].norm.bias]
        if all(p.numel() for p in norm):
            assert not _runs_share_state(flat_optimizer, norm), case
        if case == "step hook":
            assert seen == [len(list(flat.parameters()))] * 2


def test_closures_and_optimizer_step_hooks_step_per_parameter() -> None:
    run_distributed(_falls_back, 2)


def _raised(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    _backward(model, 0, rank, world_size)
    optimizer.param_groups[0]["lr"] = "not a number"
    with pytest.raises(TypeError):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 1e-2
    # The next entry into the model puts the groups and the state back.
    _backward(model, 1, rank, world_size)
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params))
    assert set(map(id, optimizer.state)) <= set(map(id, params))
    optimizer.step()
    saved = optimizer.state_dict()
    assert len(saved["state"]) == len(params)
    for index, state in saved["state"].items():
        assert state["exp_avg"].shape == params[index].shape


def test_a_step_that_raised_leaves_the_groups_as_they_were() -> None:
    run_distributed(_raised, 2)
