"""Mixed precision: parameters gathered and computed in ``param_dtype`` with
the fp32 shard as the optimizer's master copy, gradients reduced in
``reduce_dtype`` (kept low only with ``keep_low_precision_grads``), buffers
in ``buffer_dtype`` (original dtypes recorded), input casting for the root and
for every unit, per-unit overrides through ``CustomPolicy``, and training
under ``torch.autocast``, also inside activation-checkpoint re-runs.

The reference is the one of [Note: the low-precision reference] in
``tests/support/mixed_precision.py``.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from composable_shard import CustomPolicy, MixedPrecision, ShardingStrategy, fully_shard
from composable_shard.runtime import in_backward
from composable_shard.runtime.state import get_state

from tests.support.harness_pool import run_distributed
from tests.support.mixed_precision import (
    BF16,
    FP32,
    PrecisionCase,
    by_policy,
    cast_all,
    fp32_loss_step,
    run_mixed_precision_parity,
    sgd,
)
from tests.support.models import Block, TinyGPT, batch, lm_loss

def _autocast_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        logits = model(inputs)
    loss = lm_loss(logits.float(), targets)
    loss.backward()
    return loss.detach()


# ------------------------------------------------------------------ cases
def _norms_in_fp32(mixed_precision: MixedPrecision) -> Callable[[nn.Module], None]:
    """The issue's recipe: blocks in bf16, LayerNorms as their own fp32 units."""

    def decide(module: nn.Module) -> bool | dict:
        if isinstance(module, nn.LayerNorm):
            return {"mixed_precision": None}
        return isinstance(module, Block)

    def shard(model: nn.Module) -> None:
        fully_shard(model, policy=CustomPolicy(decide), mixed_precision=mixed_precision)
        norm_state = get_state(model.blocks[0].norm)
        assert norm_state is not None and norm_state.config.mixed_precision is None
        assert all(h.param_dtype == FP32 for h in norm_state.handles)
        assert all(h.param_dtype == BF16 for h in get_state(model.blocks[0]).handles)  # type: ignore[union-attr]

    return shard


class _FloatBlocks(nn.Module):
    """Float inputs: an fp32 projection owned by the root, then blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x


def _float_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randn(8, 5, 16, generator=generator), torch.randn(8, 5, 16, generator=generator)


def _mse_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = (model(inputs).float() - targets).square().mean()
    loss.backward()
    return loss.detach()


def _upcast_in_fp32_units(master: nn.Module) -> nn.Module:
    """Reference for _FloatBlocks with fp32 root and bf16 blocks that cast
    their own inputs."""
    compute = copy.deepcopy(master)
    for block in compute.blocks:
        block.to(BF16)
        block.register_forward_pre_hook(lambda module, args: tuple(a.to(BF16) for a in args))
    return compute


def _cast_forward_inputs_of_each_unit(model: nn.Module) -> None:
    blocks_mp = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True)
    for block in model.blocks:
        fully_shard(block, mixed_precision=blocks_mp)
    fully_shard(model)  # the root computes in fp32: no mixed precision


def _cast_forward_inputs_under_composable_checkpoint(model: nn.Module) -> None:
    """As ``_cast_forward_inputs_of_each_unit``, each block also under
    ``torch.distributed._composable.checkpoint``: the first applied before
    ``fully_shard``, the second after. Either order casts the inputs before
    the checkpoint saves them (FSDP2 passes both; the first raised
    ``CheckpointError``, a recomputed fp32 input against a saved bf16 one,
    while the unit's pre-forward ran after the checkpoint's)."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    blocks_mp = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True)
    first, second = model.blocks
    composable_checkpoint(first)
    fully_shard(first, mixed_precision=blocks_mp)
    fully_shard(second, mixed_precision=blocks_mp)
    composable_checkpoint(second)
    fully_shard(model)


_BF16_FP32_REDUCE = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)


def _cases() -> list[PrecisionCase]:
    return [
        PrecisionCase("bf16 compute, fp32 reduce", TinyGPT, by_policy(mixed_precision=_BF16_FP32_REDUCE)),
        PrecisionCase(
            "bf16 compute, fp32 reduce, NO_SHARD",
            TinyGPT,
            by_policy(mixed_precision=_BF16_FP32_REDUCE, strategy=ShardingStrategy.NO_SHARD),
        ),
        PrecisionCase(
            "bf16 compute and reduce (reduce_dtype defaults to param_dtype)",
            TinyGPT,
            by_policy(mixed_precision=MixedPrecision(param_dtype=BF16)),
            make_optimizer=sgd,
            exact_reduction=False,
            reduce_dtypes={BF16},
        ),
        PrecisionCase(
            "keep_low_precision_grads",
            TinyGPT,
            by_policy(mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, keep_low_precision_grads=True)),
            make_optimizer=sgd,
            exact_reduction=False,
            grad_dtype=BF16,
            reduce_dtypes={BF16},
        ),
        PrecisionCase(
            "CustomPolicy: LayerNorms in fp32",
            TinyGPT,
            _norms_in_fp32(_BF16_FP32_REDUCE),
            make_compute=functools.partial(cast_all, keep_fp32=(nn.LayerNorm,)),
        ),
        PrecisionCase(
            "cast_forward_inputs into bf16 blocks under an fp32 root",
            _FloatBlocks,
            _cast_forward_inputs_of_each_unit,
            make_compute=_upcast_in_fp32_units,
            step_fn=_mse_step,
            make_batch=_float_batch,
        ),
        PrecisionCase(
            "cast_forward_inputs into bf16 blocks under composable checkpoint, either order",
            _FloatBlocks,
            _cast_forward_inputs_under_composable_checkpoint,
            make_compute=_upcast_in_fp32_units,
            step_fn=_mse_step,
            make_batch=_float_batch,
        ),
    ]


def _mixed_precision_matches_low_precision_reference(rank: int, world_size: int) -> None:
    for case in _cases():
        run_mixed_precision_parity(case, rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision_matches_a_low_precision_data_parallel_reference(world_size: int) -> None:
    run_distributed(_mixed_precision_matches_low_precision_reference, world_size)


# ------------------------------------------------------- dtypes observed
def _record_dtypes(model: nn.Module, record: list[tuple[str, torch.dtype, torch.dtype]]) -> None:
    """Forward pre-hooks (after fully_shard's) recording each Linear's and
    LayerNorm's weight dtype and input dtype during forward."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.register_forward_pre_hook(
                lambda m, args, name=name: record.append((name, m.weight.dtype, args[0].dtype))
            )


def _compute_dtypes_and_master_copy(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    _norms_in_fp32(MixedPrecision(param_dtype=BF16))(model)
    record: list[tuple[str, torch.dtype, torch.dtype]] = []
    _record_dtypes(model, record)
    inputs, targets = batch(0)
    fp32_loss_step(model, inputs, targets)
    seen = {name: (weight, arg) for name, weight, arg in record}
    assert seen["blocks.0.fc_in"] == (BF16, BF16), seen
    assert seen["head"] == (BF16, BF16), seen  # the tied head is gathered in bf16 with the root
    assert seen["blocks.0.norm"][0] == FP32 and seen["norm"][0] == FP32, seen  # fp32 override
    # Outside forward: fp32 master shards, and that is what the optimizer sees.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert all(p.dtype == FP32 for group in optimizer.param_groups for p in group["params"])


def _root_input_casting(rank: int, world_size: int) -> None:
    seen: list[torch.dtype] = []
    for cast_root, expected in ((True, BF16), (False, FP32)):
        model = nn.Sequential(Block(), Block())
        mixed_precision = MixedPrecision(param_dtype=BF16, cast_root_forward_inputs=cast_root, cast_forward_inputs=True)
        fully_shard(model, policy={Block}, mixed_precision=mixed_precision)
        seen.clear()
        model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        output = model(torch.randn(2, 3, 16))
        assert seen == [expected, BF16], (cast_root, seen)  # blocks cast their own inputs
        assert output.dtype == BF16
    # Integer inputs are never cast.
    model = TinyGPT()
    fully_shard(model, policy={Block}, mixed_precision=MixedPrecision(param_dtype=BF16))
    assert model(batch(0)[0]).dtype == BF16


def _buffers_in_buffer_dtype(rank: int, world_size: int) -> None:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.bn = nn.BatchNorm1d(16)
            self.register_buffer("scale", torch.full((16,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.block(x).transpose(1, 2)).transpose(1, 2) * self.scale

    def keep_block_buffers_fp32(module: nn.Module) -> bool | dict:
        if isinstance(module, Block):
            return {"mixed_precision": MixedPrecision(param_dtype=BF16)}  # no buffer_dtype: buffers keep theirs
        return False

    model = Normed()
    model.block.register_buffer("offset", torch.zeros(16, dtype=torch.float64))
    buffers_before = dict(model.named_buffers())
    mixed_precision = MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)
    fully_shard(model, policy=CustomPolicy(keep_block_buffers_fp32), mixed_precision=mixed_precision)
    assert dict(model.named_buffers()) == buffers_before  # same tensor objects, never sharded
    assert model.scale.dtype == BF16 and model.scale.shape == (16,) and torch.all(model.scale == 0.5)
    assert model.bn.running_mean.dtype == BF16 and model.bn.running_var.dtype == BF16
    assert model.bn.num_batches_tracked.dtype == torch.int64  # only floating-point buffers are cast
    assert model.block.offset.dtype == torch.float64  # its unit has no buffer_dtype
    assert get_state(model).buffer_dtypes_of(model) == {"bn.running_mean": FP32, "bn.running_var": FP32, "scale": FP32}  # type: ignore[union-attr]
    assert get_state(model.block).buffer_dtypes_of(model.block) == {}  # type: ignore[union-attr]
    output = model(torch.randn(4, 3, 16))
    assert output.dtype == BF16 and model.bn.running_mean.dtype == BF16
    output.float().sum().backward()


@pytest.mark.parametrize("world_size", [2])
def test_compute_dtypes_input_casting_and_buffer_dtypes(world_size: int) -> None:
    run_distributed(_compute_dtypes_and_master_copy, world_size)
    run_distributed(_root_input_casting, world_size)
    run_distributed(_buffers_in_buffer_dtype, world_size)


# --------------------------------------------------------------- autocast
class _ProbeBlock(Block):
    """Records, on every forward (first run and checkpoint re-run), whether
    it runs inside backward, the autocast state and its matmul's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.probe: list[tuple[bool, bool, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc_in(self.norm(x))
        self.probe.append((in_backward(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), hidden.dtype))
        return x + self.fc_out(torch.nn.functional.gelu(hidden))


class _CheckpointedGPT(TinyGPT):
    use_reentrant: bool | None = None  # None: no checkpointing

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ProbeBlock() for _ in range(3)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x) if self.use_reentrant is None else checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.norm(x))


def _checkpointed_gpt(use_reentrant: bool | None) -> nn.Module:
    model = _CheckpointedGPT()
    model.use_reentrant = use_reentrant
    return model


def _autocast_matches_reference(rank: int, world_size: int) -> None:
    shard_blocks = lambda model: fully_shard(model, policy={_ProbeBlock})  # noqa: E731
    for use_reentrant in (None, False, True):
        case = PrecisionCase(
            f"autocast(bf16), checkpoint use_reentrant={use_reentrant}",
            functools.partial(_checkpointed_gpt, use_reentrant),
            shard_blocks,
            make_compute=copy.deepcopy,
            step_fn=_autocast_step,
        )
        model = run_mixed_precision_parity(case, rank, world_size)
        sharded_block = model.blocks[1].probe
        # Every forward, first run and re-run alike, ran under bf16 autocast.
        assert sharded_block and all(entry[1:] == (True, BF16, BF16) for entry in sharded_block), sharded_block
        reruns = [entry for entry in sharded_block if entry[0]]
        assert len(reruns) == (0 if use_reentrant is None else len(sharded_block) // 2), sharded_block
    # autocast on top of bf16 mixed precision.
    run_mixed_precision_parity(
        PrecisionCase(
            "autocast over MixedPrecision(bf16), non-reentrant checkpoint",
            functools.partial(_checkpointed_gpt, False),
            lambda model: fully_shard(model, policy={_ProbeBlock}, mixed_precision=_BF16_FP32_REDUCE),
            make_compute=cast_all,
            step_fn=_autocast_step,
        ),
        rank,
        world_size,
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_autocast_and_checkpoint_reruns_under_autocast_match_reference(world_size: int) -> None:
    run_distributed(_autocast_matches_reference, world_size)
