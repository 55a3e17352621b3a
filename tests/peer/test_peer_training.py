"""Ports of FSDP2's test_fully_shard_training.py and test_fully_shard_init.py
training scenarios (see tests/peer/SCENARIOS.md), each in parity with one
process: one unit with uneven shapes; several units with delayed
collectives; forward and backward through a non-root unit; a unit run twice
per forward; a module listed twice and parameters shared across modules;
the first forward through a non-root unit; containers with a forward;
scalar and channels-last parameters; a unit method other than forward
(``register_forward_method``); gradient accumulation in every mode."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint

from composable_shard import ShardingStrategy, comm, fully_shard, no_sync, register_forward_method
from composable_shard.runtime.state import get_state

from tests.support.comm_spies import CollectiveSpy, with_reductions_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import MLP
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups
from tests.support.peer_parity import float_batch, local_slice, mean_square, train_in_parity

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def _units_and_root(units: Callable[[nn.Module], list[nn.Module]], **kwargs: Any) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for unit in units(model):
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)

    return shard


@contextlib.contextmanager
def _delayed(name: str, seconds: float) -> Iterator[None]:
    """Every ``comm.<name>`` call sleeps first (the CPU stand-in for FSDP2's
    ``torch.cuda._sleep`` before a collective): waits must still order it."""
    original = getattr(comm, name)

    def delayed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(comm, name, delayed)
    try:
        yield
    finally:
        setattr(comm, name, original)


class _TwiceInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


class _DictWithForward(nn.ModuleDict):
    def __init__(self) -> None:
        super().__init__({"lin": nn.Linear(8, 8), "out": nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["out"](torch.relu(self["lin"](x)))


class _ListWithForward(nn.ModuleList):
    def __init__(self) -> None:
        super().__init__([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = torch.relu(layer(x))
        return x


class _ScalarScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.head = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5, 5, 3) -> (B, 8)
        return self.head(self.conv(x.permute(0, 3, 1, 2)).mean((2, 3)))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.patch(images).flatten(2).transpose(1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_features(images).sum(1)


class _EncoderAndHead(nn.Module):
    """Calls its encoder's ``forward_features``, never its ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()
        self.head = nn.Linear(8, 8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 4, 4, 3)
        return self.head(self.encoder.forward_features(images.permute(0, 3, 1, 2)))


def _core_training_scenarios(rank: int, world_size: int) -> None:
    # One unit (the root) with uneven shapes.
    for shapes in (((16, 15), (15, 8)), ((7, 15), (15, 3))):
        train_in_parity(
            lambda: nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1])),
            fully_shard,
            dim=shapes[0][0],
            when=f"single unit {shapes}",
        )
    # Several units, with all-gathers or reduce-scatters delayed.
    for strategy in STRATEGIES:
        for delayed in (None, "all_gather_into", "reduce_scatter"):
            with _delayed(delayed, 0.01) if delayed else contextlib.nullcontext():
                train_in_parity(
                    lambda: nn.Sequential(*[MLP(8) for _ in range(3)]),
                    _units_and_root(list, strategy=strategy),
                    dim=8,
                    when=f"{strategy.name} delayed {delayed}",
                )
    # A unit run twice per forward.
    for strategy in STRATEGIES:
        train_in_parity(
            _TwiceInner, _units_and_root(lambda m: [m.inner], strategy=strategy), dim=4, steps=4, when=f"inner twice {strategy.name}"
        )

    # A module listed twice, and a weight shared by two MLPs (the root owns it).
    def duplicated() -> nn.Module:
        mlp = MLP(6)
        return nn.Sequential(mlp, MLP(6), mlp)

    def shared_weight() -> nn.Module:
        model = nn.Sequential(*[MLP(6) for _ in range(3)])
        model[0].in_proj.weight = model[1].in_proj.weight
        model[2].in_proj.weight = model[1].in_proj.weight
        return model

    train_in_parity(duplicated, fully_shard, dim=6, when="duplicate module")
    train_in_parity(duplicated, _units_and_root(lambda m: [m[0]]), dim=6, when="duplicate module as a unit")
    train_in_parity(shared_weight, fully_shard, dim=6, when="shared weight")
    # Containers with their own forward, scalar and channels-last parameters.
    for build in (_DictWithForward, _ListWithForward, _ScalarScale):
        train_in_parity(build, _units_and_root(lambda m: [m.lin] if isinstance(m, _ScalarScale) else []), dim=8, when=build.__name__)
    train_in_parity(
        _ConvNet, _units_and_root(lambda m: [m.conv]), dim=3, make_batch=lambda s: float_batch(s, 3, shape=(5, 5)), when="channels last"
    )
    # A unit's other method, registered to run like forward.
    register = _units_and_root(lambda m: [m.encoder, m.head])
    train_in_parity(
        _EncoderAndHead,
        lambda m: (register(m), register_forward_method(m.encoder, "forward_features")),
        dim=3,
        make_batch=lambda s: float_batch(s, 3, shape=(4, 4)),
        when="register_forward_method",
    )
    with pytest.raises(ValueError, match=r"register_forward_method\(Linear, 'forward_features'\): this module is not a unit"):
        register_forward_method(nn.Linear(2, 2), "forward_features")
    unit = fully_shard(nn.Linear(2, 2))
    for bad in ("nope", "forward"):
        with pytest.raises(ValueError, match=rf"Linear has no method '{bad}' other than forward"):
            register_forward_method(unit, bad)


def test_core_training_scenarios_match_reference() -> None:
    run_distributed(_core_training_scenarios, 2)


def _non_root_and_first_forward_scenarios(rank: int, world_size: int) -> None:
    """A step through the root, then one through a non-root unit alone; and
    a model whose first forward goes through a non-root unit."""
    for first_through_non_root in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(8) for _ in range(3)])
        reference = copy.deepcopy(model)
        _units_and_root(list)(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
        parity = Parity(build=lambda: model, shard=lambda m: None, reference_optimizer=reference_optimizer)
        order = ("non-root", "root", "non-root", "root") if first_through_non_root else ("root", "non-root", "root")
        for step, through in enumerate(order):
            inputs = float_batch(step, 8)
            run: Callable[[nn.Module], nn.Module] = (lambda m: m[0]) if through == "non-root" else (lambda m: m)
            mean_square(run(reference)(inputs)).backward()
            mean_square(run(model)(local_slice(inputs))).backward()
            assert_resharded(model)
            compare_full(model, reference, parity, f"step {step} through the {through}", grads=True)
            for opt in (optimizer, reference_optimizer):
                opt.step()
                opt.zero_grad()
        assert get_state(model).is_root and not get_state(model[0]).is_root


def test_forward_through_a_non_root_unit_matches_reference() -> None:
    run_distributed(_non_root_and_first_forward_scenarios, 2)


@with_reductions_alone  # counts reductions per flat parameter
def _gradient_accumulation_modes(rank: int, world_size: int) -> None:
    """Three micro-batches; no_sync over the whole model, over some units
    only, or not at all; gradients compared after each step's last
    micro-batch, ``zero_grad`` alternating between None and zeros (which
    mixes accumulation with and without communication); reductions counted."""
    micro_batches, n_mlps = 3, 3
    for strategy in STRATEGIES:
        for mode in ("all", "some_units", "none"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), *[MLP(8) for _ in range(n_mlps)])
            reference = copy.deepcopy(model)
            _units_and_root(lambda m: list(m)[1:], strategy=strategy)(model)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
            parity = Parity(build=lambda: model, shard=lambda m: None, atol=5e-6, reference_optimizer=reference_optimizer)
            for step in range(3):
                spy = CollectiveSpy()
                for micro in range(micro_batches):
                    inputs = float_batch(step * micro_batches + micro, 8)
                    mean_square(reference(inputs)).backward()
                    last = micro == micro_batches - 1
                    context: Any = contextlib.nullcontext()
                    if not last and mode == "all":
                        context = no_sync(model)
                    elif not last and mode == "some_units":
                        context = contextlib.ExitStack()
                        for unit in (model[1], model[2]):
                            context.enter_context(no_sync(unit))
                    with spy.watching(), context:
                        mean_square(model(local_slice(inputs))).backward()
                reductions = spy.counts()["reduce_scatter"]
                expected = {"all": n_mlps + 1, "some_units": (n_mlps + 1) * micro_batches - 2 * (micro_batches - 1), "none": (n_mlps + 1) * micro_batches}[mode]
                assert reductions == expected, (strategy, mode, reductions, expected)
                assert_resharded(model)
                compare_full(model, reference, parity, f"{strategy.name} {mode} step {step}", grads=True)
                for opt in (optimizer, reference_optimizer):
                    opt.step()
                    opt.zero_grad(set_to_none=step % 2 == 1)
                compare_full(model, reference, parity, f"{strategy.name} {mode} step {step} after step", grads=False)


@pytest.mark.parametrize("world_size", [2])
def test_gradient_accumulation_in_every_mode_matches_reference(world_size: int) -> None:
    run_distributed(_gradient_accumulation_modes, world_size)



def _hybrid_with_checkpointing_and_accumulation(rank: int, world_size: int) -> None:
    """HYBRID_SHARD (2 x 2) with composable checkpointing and no_sync over
    the first two of three micro-batches, odd and even widths."""
    shard_group, replicate_group = hybrid_groups(world_size)
    micro_batches = 3
    for dim in (3, 17):
        for use_checkpoint in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.LayerNorm(dim, bias=False), MLP(dim, 3), MLP(dim), MLP(dim, 3))
            reference = copy.deepcopy(model)
            for module in model:
                if use_checkpoint:
                    composable_checkpoint(module)
                fully_shard(module, strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
            fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
            parity = Parity(build=lambda: model, shard=lambda m: None, atol=5e-6, reference_optimizer=reference_optimizer)
            for step in range(2):
                for micro in range(micro_batches):
                    inputs = float_batch(step * micro_batches + micro, dim)
                    mean_square(reference(inputs)).backward()
                    with no_sync(model) if micro < micro_batches - 1 else contextlib.nullcontext():
                        mean_square(model(local_slice(inputs))).backward()
                assert_resharded(model)
                compare_full(model, reference, parity, f"dim {dim} checkpoint={use_checkpoint} step {step}", grads=True)
                for opt in (optimizer, reference_optimizer):
                    opt.step()
                    opt.zero_grad(set_to_none=step % 2 == 0)


def test_hybrid_shard_with_checkpointing_and_accumulation_matches_reference() -> None:
    run_distributed(_hybrid_with_checkpointing_and_accumulation, 4)
