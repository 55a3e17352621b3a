"""Ports of FSDP2's test_fully_shard_mixed_precision.py scenarios (see
tests/peer/SCENARIOS.md): fp16 compute and reduction, fp32 compute with a
bf16 reduction, and a bf16 model with a bf16 policy, each against the
low-precision data-parallel reference of tests/support/mixed_precision.py; gradient
accumulation under ``no_sync`` with bf16 compute and fp32 reduction; the
inputs each unit sees under per-unit policies and external inputs; norm
modules as their own units; a dataclass input cast by the root."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
import torch.nn as nn

from composable_shard import MixedPrecision, fully_shard, no_sync, unshard_params

from tests.support.comm_spies import CollectiveSpy
from tests.support.harness_pool import run_distributed
from tests.support.mixed_precision import (
    BF16,
    FP32,
    PrecisionCase,
    by_policy,
    cast_all,
    fp32_loss_step,
    reference_step,
    run_mixed_precision_parity,
    sgd,
    tolerances,
)
from tests.support.models import TinyGPT, batch

FP16 = torch.float16


def _bf16_initialised_gpt() -> nn.Module:
    return TinyGPT().to(BF16)


def _low_precision_cases() -> list[PrecisionCase]:
    return [
        PrecisionCase(
            "fp16 compute and reduce",
            TinyGPT,
            by_policy(mixed_precision=MixedPrecision(param_dtype=FP16)),
            make_compute=functools.partial(cast_all, dtype=FP16),
            make_optimizer=sgd,
            exact_reduction=False,
            reduce_dtypes={FP16},
        ),
        PrecisionCase(
            "fp32 compute, bf16 reduce",
            TinyGPT,
            by_policy(mixed_precision=MixedPrecision(reduce_dtype=BF16)),
            make_compute=functools.partial(cast_all, dtype=FP32),
            make_optimizer=sgd,
            exact_reduction=False,
            reduce_dtypes={BF16},
        ),
    ]


def _low_precision_cases_match_reference(rank: int, world_size: int) -> None:
    for case in _low_precision_cases():
        run_mixed_precision_parity(case, rank, world_size)
    # A model initialised in bf16 under a bf16 policy reduces in bf16 (its
    # own dtype; nothing is clamped to fp32).
    model = _bf16_initialised_gpt()
    fully_shard(model, policy={type(model.blocks[0])}, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16))
    spy = CollectiveSpy()
    inputs, targets = batch(0)
    with spy.watching():
        fp32_loss_step(model, inputs[rank::world_size], targets[rank::world_size])
    reduced = {dtype for _, dtype in spy.reductions_issued("reduce_scatter")}
    assert reduced == {BF16}, reduced
    assert all(p.dtype == BF16 and p.grad.dtype == BF16 for p in model.parameters())


def test_fp16_compute_and_bf16_reduction_match_low_precision_reference() -> None:
    run_distributed(_low_precision_cases_match_reference, 2)


def _accumulation_with_fp32_reduction(rank: int, world_size: int) -> None:
    """bf16 compute, fp32 reduction, four micro-batches under no_sync: the
    reduced sum matches the fp32 sum of the bf16 micro-batch gradients up to
    bf16 rounding (inside no_sync the unsharded gradient accumulates in the
    compute dtype, as composable_shard.no_sync documents; FSDP2 accumulates
    in the reduce dtype)."""
    policy = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    case = PrecisionCase("no_sync bf16/fp32", TinyGPT, by_policy(mixed_precision=policy), exact_reduction=False)
    torch.manual_seed(0)
    model = TinyGPT()
    master = copy.deepcopy(model)
    case.shard(model)
    micro_batches = 4
    for step in range(2):
        with unshard_params(model, writeback=False), torch.no_grad():
            for param, master_param in zip(model.parameters(), master.parameters()):
                master_param.copy_(param)
        summed: dict[str, torch.Tensor] = {}
        for micro in range(micro_batches):
            inputs, targets = batch(10 * step + micro)
            _, grads = reference_step(master, case, inputs, targets, world_size)
            for name, grad in grads.items():
                summed[name] = summed.get(name, 0) + grad
            local = slice(rank * inputs.shape[0] // world_size, (rank + 1) * inputs.shape[0] // world_size)
            with no_sync(model) if micro < micro_batches - 1 else contextlib.nullcontext():
                fp32_loss_step(model, inputs[local], targets[local])
        with unshard_params(model, with_grads=True, writeback=False):
            for name, param in model.named_parameters():
                assert param.grad.dtype == FP32
                expected = summed[name]
                torch.testing.assert_close(param.grad, expected, **tolerances(case, expected), msg=lambda m: f"step {step} {name}: {m}")
        for param in model.parameters():
            param.grad = None


def test_accumulation_under_no_sync_with_fp32_reduction_matches_reference() -> None:
    run_distributed(_accumulation_with_fp32_reduction, 2)


class _Recorder(nn.Module):
    """Runs ``inner`` and records the dtype of every input it got."""

    def __init__(self, inner: nn.Module, name: str, seen: dict[str, list[torch.dtype]]) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self.seen = seen

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.seen[self.name] = [x.dtype for x in inputs]
        return self.inner(inputs[0])


class _TwoChildren(nn.Module):
    def __init__(self, seen: dict[str, list[torch.dtype]], *, external: bool = False) -> None:
        super().__init__()
        self.c1 = _Recorder(nn.Linear(16, 16), "c1", seen)
        self.c2 = _Recorder(nn.Linear(16, 16), "c2", seen)
        self.external = external
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["root"] = [x.dtype]
        hidden = self.c1(x)
        if self.external:  # an input the root did not get, made in fp32
            return self.c2(hidden, torch.ones(2, 16))
        return self.c2(hidden.to(self.c2.inner.weight.dtype) if hidden.dtype != FP32 else hidden)


def _inputs_under_per_unit_policies(rank: int, world_size: int) -> None:
    seen: dict[str, list[torch.dtype]] = {}
    # fp16 on the second child only, casting its own inputs.
    model = _TwoChildren(seen)
    fully_shard(model.c2, mixed_precision=MixedPrecision(param_dtype=FP16, cast_forward_inputs=True))
    fully_shard(model)
    model(torch.zeros(2, 16)).sum().backward()
    assert seen == {"root": [FP32], "c1": [FP32], "c2": [FP16]}, seen
    # External inputs: cast by a unit only when it casts its forward inputs.
    for cast in (False, True):
        seen.clear()
        model = _TwoChildren(seen, external=True)
        fully_shard(model.c2, mixed_precision=MixedPrecision(param_dtype=FP16, cast_forward_inputs=cast))
        fully_shard(model, mixed_precision=MixedPrecision(param_dtype=FP16))
        model(torch.zeros(2, 16)).sum().backward()
        assert seen == {"root": [FP16], "c1": [FP16], "c2": [FP16, FP16 if cast else FP32]}, (cast, seen)


def _norm_modules_as_units(rank: int, world_size: int) -> None:
    for dtype in (BF16, FP16):
        builds = {
            "layer norm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)), (4, 8)),
            "batch norm 1d": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)), (4, 8)),
            "batch norm 2d": (lambda: nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3)), (3, 1, 9, 9)),
        }
        for name, (build, shape) in builds.items():
            model = build()
            policy = MixedPrecision(param_dtype=dtype, buffer_dtype=dtype)
            for module in (*model, model):
                fully_shard(module, mixed_precision=policy)
            output = model(torch.randn(shape))
            assert output.dtype == dtype, (name, dtype, output.dtype)
            output.float().sum().backward()
            assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters()), (name, dtype)


@dataclasses.dataclass
class _Input:
    x: torch.Tensor
    tag: str = "input"


class _TakesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(10, 10)

    def forward(self, inputs: _Input) -> torch.Tensor:
        return self.layer(inputs.x)


def _dataclass_input_is_cast(rank: int, world_size: int) -> None:
    model = _TakesDataclass()
    fully_shard(model, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16))
    inputs = _Input(torch.randn(2, 10))
    output = model(inputs)
    assert output.dtype == BF16 and inputs.x.dtype == FP32  # the caller's object is left as it was
    output.float().sum().backward()
    assert model.layer.weight.grad is not None


def _casting_scenarios(rank: int, world_size: int) -> None:
    _inputs_under_per_unit_policies(rank, world_size)
    _norm_modules_as_units(rank, world_size)
    _dataclass_input_is_cast(rank, world_size)


def test_inputs_norm_units_and_dataclass_inputs_get_the_policy_dtypes() -> None:
    run_distributed(_casting_scenarios, 2)

