"""``SmallUnitGroups``: runs of consecutive small units a policy picks become
one group each ([Note: groups of small units] in composable_shard/policy.py).
Which units group (siblings, adjacent, small, within the group size, one
set of overrides, none holding another unit), parity with the
single-process model step by step under every layout, with activation
checkpointing, mixed precision and torch.compile, one all-gather per
group, and under a memory budget: the groups where the budget holds them,
else the base policy's units. The plan's bytes and peak for groups are checked with every
other case by tests/planning/test_plan.py (``small_unit_groups``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import composable_shard as cs
from composable_shard import CustomPolicy, MixedPrecision, ShardingStrategy, SmallUnitGroups, fully_shard
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.comm_spies import CommSpy, with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.mixed_precision import BF16, FP32, PrecisionCase, run_mixed_precision_parity
from tests.support.models import Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, run_parity

NS, SGO, FS = ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD
# A TinyGPT block's parameters (fp32): groups of up to four such blocks fit
# GROUP_BYTES, and each block is at most a quarter of it.
BLOCK_BYTES = sum(p.numel() * p.element_size() for p in Block().parameters())
GROUP_BYTES = 4 * BLOCK_BYTES


def _names(model: nn.Module, policy: object) -> list[list[str]]:
    """The units ``policy`` picks in ``model``, as lists of module names."""
    names = {id(m): n for n, m in model.named_modules()}
    return [[names[id(m)] for m in choice.modules] for choice in policy.select(model, lambda m: False)]  # type: ignore[attr-defined]


def test_runs_of_small_adjacent_siblings_become_groups() -> None:
    model = TinyGPT(n_blocks=6)
    # Four blocks fill a group; the fifth and sixth start the next one.
    assert _names(model, SmallUnitGroups({Block}, max_bytes=GROUP_BYTES)) == [
        ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        ["blocks.4", "blocks.5"],
    ]
    # A block larger than a quarter of the group size stays alone and ends the run.
    model.blocks[2] = Block(hidden=200)  # type: ignore[index]
    assert _names(model, SmallUnitGroups({Block}, max_bytes=GROUP_BYTES)) == [
        ["blocks.0", "blocks.1"], ["blocks.2"], ["blocks.3", "blocks.4", "blocks.5"],
    ]
    # A group of one is a unit as the base policy picks it.
    assert _names(model, SmallUnitGroups({Block}, max_bytes=BLOCK_BYTES * 4 + 1)) == _names(
        model, SmallUnitGroups({Block}, max_bytes=GROUP_BYTES)
    )
    assert _names(TinyGPT(n_blocks=3), SmallUnitGroups({Block}, max_bytes=4 * BLOCK_BYTES - 1)) == [
        ["blocks.0"], ["blocks.1"], ["blocks.2"],
    ]


class _TwoStacks(nn.Module):
    """Blocks under two parents, a plain module between two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList([Block(), Block()])
        self.second = nn.ModuleList([Block(), nn.Identity(), Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in [*self.first, *self.second]:
            x = module(x)
        return x


class _Stage(nn.Module):
    """A unit that holds units of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_groups_are_siblings_adjacent_of_one_override_and_hold_no_unit() -> None:
    model = _TwoStacks()
    assert _names(model, SmallUnitGroups({Block}, max_bytes=GROUP_BYTES)) == [
        ["first.0", "first.1"], ["second.0"], ["second.2", "second.3"],
    ]
    # Units whose fully_shard overrides differ do not share a group.
    stack = TinyGPT(n_blocks=4)
    odd = {id(block) for block in list(stack.blocks)[1::2]}  # type: ignore[arg-type]
    policy = CustomPolicy(lambda m: ({"strategy": NS} if id(m) in odd else True) if isinstance(m, Block) else False)
    assert _names(stack, SmallUnitGroups(policy, max_bytes=GROUP_BYTES)) == [
        ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"],
    ]
    same = CustomPolicy(lambda m: {"strategy": NS} if isinstance(m, Block) else False)
    grouped = SmallUnitGroups(same, max_bytes=GROUP_BYTES).select(stack, lambda m: False)
    assert [len(choice.modules) for choice in grouped] == [4] and grouped[0].overrides == {"strategy": NS}
    # A unit holding units is never grouped (its blocks may be).
    stages = nn.Sequential(_Stage(), _Stage())
    assert _names(stages, SmallUnitGroups({Block, _Stage}, max_bytes=GROUP_BYTES)) == [
        ["0.blocks.0", "0.blocks.1"], ["0"], ["1.blocks.0", "1.blocks.1"], ["1"],
    ]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"SmallUnitGroups: max_bytes must be a positive int number of bytes, got 0"):
        SmallUnitGroups({Block}, max_bytes=0)
    with pytest.raises(ValueError, match=r"got 1.5"):
        SmallUnitGroups({Block}, max_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SmallUnitGroups: base must be the policy whose units are grouped"):
        SmallUnitGroups(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got SmallUnitGroups"):
        SmallUnitGroups(SmallUnitGroups({Block}))  # type: ignore[arg-type]


def test_a_parameter_blocks_of_one_group_share_belongs_to_the_group() -> None:
    model = _tied_blocks(4)
    alone = cs.plan(model, world_size=2, policy={Block}, device="cpu")
    assert any("'blocks.0.fc_in.weight' is used by units ['blocks.0', 'blocks.1']" in w for w in alone.warnings)
    grouped = cs.plan(model, world_size=2, policy=SmallUnitGroups({Block}, max_bytes=GROUP_BYTES), device="cpu")
    assert [unit.name for unit in grouped.units] == ["", "blocks.0+blocks.1+blocks.2+blocks.3"]
    assert not any("is used by units" in w for w in grouped.warnings), grouped.warnings
    # The group holds the four blocks' parameters, the shared weight once.
    assert grouped.units[1].numel == 4 * sum(p.numel() for p in Block().parameters()) - model.blocks[0].fc_in.weight.numel()  # type: ignore[index]


def test_the_plan_advises_grouping_many_small_units() -> None:
    model = TinyGPT(n_blocks=8)
    alone = cs.plan(model, world_size=2, policy={Block}, device="cpu")
    assert "8 units hold at most 256 KiB of parameters each ('blocks.0', ...)" in "\n".join(alone.warnings)
    assert "policy=SmallUnitGroups(<the policy>)" in str(alone)
    # Grouped, or fewer than eight: no advice.
    grouped = cs.plan(model, world_size=2, policy=SmallUnitGroups({Block}), device="cpu")
    assert not grouped.warnings, grouped.warnings
    assert not cs.plan(TinyGPT(n_blocks=7), world_size=2, policy={Block}, device="cpu").warnings


class _CheckpointedGPT(TinyGPT):
    """Every block under non-reentrant activation checkpointing."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


def _grouped(strategy: ShardingStrategy, **kwargs: object):
    def shard(model: nn.Module) -> None:
        fully_shard(model, policy=SmallUnitGroups({Block}, max_bytes=GROUP_BYTES), strategy=strategy, **kwargs)
        blocks = list(model.blocks)  # type: ignore[arg-type]
        assert all(get_state(block) is get_state(blocks[0]) for block in blocks[:4])
        assert get_state(blocks[4]) is not get_state(blocks[0])
        assert [name for name, _ in unit_states_under(model)] == ["", "blocks.0+blocks.1+blocks.2+blocks.3", "blocks.4"]

    return shard


def _tied_blocks(n_blocks: int) -> nn.Module:
    """Blocks 0 and 1 share their input projection's weight."""
    model = TinyGPT(n_blocks=n_blocks)
    model.blocks[1].fc_in.weight = model.blocks[0].fc_in.weight  # type: ignore[index]
    return model


def _groups_match_reference(rank: int, world_size: int) -> None:
    cases = {
        "FULL_SHARD": (TinyGPT, _grouped(FS)),
        "FULL_SHARD, a weight two blocks of the group share": (_tied_blocks, _grouped(FS)),
        "SHARD_GRAD_OP": (TinyGPT, _grouped(SGO)),
        "NO_SHARD": (TinyGPT, _grouped(NS)),
        "FULL_SHARD, checkpointed blocks": (_CheckpointedGPT, _grouped(FS)),
    }
    for name, (model_class, shard) in cases.items():
        parity = Parity(build=functools.partial(model_class, n_blocks=5), shard=shard)
        try:
            run_parity(parity)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
        assert {"blocks.0.fc_in.weight", "blocks.3.fc_out.bias", "blocks.4.norm.weight"} <= set(parity.compared), name
    # bf16 compute, fp32 reductions: against the low-precision data-parallel reference.
    bf16 = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    run_mixed_precision_parity(
        PrecisionCase("groups, bf16 compute", functools.partial(TinyGPT, n_blocks=5), _grouped(FS, mixed_precision=bf16)),
        rank,
        world_size,
    )


def test_small_unit_groups_train_in_parity_with_the_single_process_model() -> None:
    run_distributed(_groups_match_reference, 2)


@with_collectives_alone  # counts each unit's all-gathers
def _one_all_gather_per_group(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=5)
    _grouped(FS)(model)
    inputs, targets = batch(0, 2)
    for step in range(2):
        with CommSpy() as spy:
            logits = model(inputs)
        # The group of four, the fifth block and the root.
        assert spy.calls.count("all_gather_into") == 3, (step, spy.calls)
        lm_loss(logits, targets).backward()
        assert_resharded(model)


def test_a_group_of_small_units_is_gathered_once_per_forward() -> None:
    run_distributed(_one_all_gather_per_group, 2)


def _wide_gpt() -> nn.Module:
    """Five blocks of 528 KiB (wide hidden layers): a group of four holds
    more at once than the runtime saves on three fewer units, so a budget
    can hold the blocks alone and not the group."""
    model = TinyGPT(n_blocks=0)
    model.blocks = nn.ModuleList([Block(hidden=4096) for _ in range(5)])
    return model


WIDE_GROUP_BYTES = 4 * sum(p.numel() * p.element_size() for p in Block(hidden=4096).parameters())


def _wide_policy() -> SmallUnitGroups:
    return SmallUnitGroups({Block}, max_bytes=WIDE_GROUP_BYTES)


def _alone_peak(model: nn.Module) -> int:
    """The peak on 2 ranks with every unit FULL_SHARD, each block alone."""
    return cs.plan(model, world_size=2, policy={Block}, device="cpu").rank_bytes["total"]


def test_a_budget_keeps_the_groups_where_it_holds_them_else_the_base_units() -> None:
    model = _wide_gpt()
    policy = _wide_policy()
    grouped_peak = cs.plan(model, world_size=2, policy=policy, device="cpu").rank_bytes["total"]
    assert grouped_peak > _alone_peak(model)  # the group holds more at once
    roomy = cs.plan(model, world_size=2, policy=policy, device="cpu", memory_budget=1 << 40)
    assert [(layout.name, layout.strategy) for layout in roomy.layouts] == [
        ("", NS), ("blocks.0+blocks.1+blocks.2+blocks.3", NS), ("blocks.4", NS),
    ]
    assert "; runs of small units grouped, up to " in str(roomy)
    applied = roomy.layout_policy()
    assert applied.base is policy
    assert cs.plan(model, world_size=2, policy=applied, strategy=applied.root_strategy, device="cpu").units == roomy.units
    # Held with each block alone, not grouped: the base policy's units.
    tight = cs.plan(model, world_size=2, policy=policy, device="cpu", memory_budget=_alone_peak(model))
    assert [layout.name for layout in tight.layouts] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"]
    assert tight.layout_policy().base is policy.base and "runs of small units grouped" not in str(tight)
    assert tight.rank_bytes["total"] <= _alone_peak(model) < grouped_peak
    with pytest.raises(ValueError, match=r"memory_budget 1000 B \(1000 bytes\) per rank is below this model's peak"):
        cs.plan(model, world_size=2, policy=policy, device="cpu", memory_budget=1000)


def _budgeted_groups_train(rank: int, world_size: int) -> None:
    for budget in ("roomy", "tight"):

        def shard(model: nn.Module, budget: str = budget) -> None:
            limit = 1 << 40 if budget == "roomy" else _alone_peak(model)
            fully_shard(model, policy=_wide_policy(), memory_budget=limit)
            grouped = get_state(model.blocks[0]) is get_state(model.blocks[1])  # type: ignore[index]
            assert grouped == (budget == "roomy"), budget

        try:
            # AdamW: its steps amplify these wide layers' round-off into the
            # next gradients ([Note: gradients after an adaptive step] in
            # tests/support/parity.py).
            run_parity(Parity(build=_wide_gpt, shard=shard))
        except AssertionError as error:
            raise AssertionError(f"{budget}: {error}") from error


def test_fully_shard_with_a_budget_trains_the_groups_it_chose_in_parity() -> None:
    run_distributed(_budgeted_groups_train, 2)


def _compiled_groups_train(rank: int, world_size: int) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    for how in ("each block", "the whole model"):

        def shard(model: nn.Module, how: str = how) -> None:
            fully_shard(model, policy=SmallUnitGroups({Block}))  # first shard, then compile (as with FSDP2)
            for module in model.blocks if how == "each block" else [model]:  # type: ignore[union-attr]
                module.compile(backend="aot_eager")

        torch._dynamo.reset()
        counters.clear()  # reset() keeps them
        try:
            run_parity(Parity(build=functools.partial(TinyGPT, n_blocks=4), shard=shard))
            assert counters["stats"]["unique_graphs"] > 0, f"{how}: dynamo compiled no graph"
        except AssertionError as error:
            raise AssertionError(f"{how} compiled: {error}") from error
        finally:
            torch._dynamo.reset()  # no compiled frames left in the warm worker


def test_groups_compiled_per_block_or_whole_train_in_parity() -> None:
    run_distributed(_compiled_groups_train, 2, timeout=300)
