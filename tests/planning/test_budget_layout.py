"""A layout chosen for a memory budget ([Note: a layout chosen for a memory
budget] in composable_shard/planning/budget.py): for a LoRA stack (frozen
base, trainable adapters) and a GPT, a roomy budget replicates every unit
and a tight one shards; the chosen plan is the plan of its own
``layout_policy()``, what the allocator holds matches it, the model trains
like one process, and bad budgets are refused by name, leaving the model
as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import composable_shard as cs
from composable_shard import CustomPolicy, LayoutPolicy, ShardingStrategy, fully_shard, is_fully_sharded
from composable_shard.runtime.state import UnitState, unit_states_under
from tests.support.budget_layout import (
    BATCH,
    MODELS,
    SEQ,
    VOCAB,
    budget_plan,
    budgets,
    lora_stack,
    measure_budgeted,
    measure_chosen,
    uniform_peak,
    unit_strategies,
)
from tests.support.comm_spies import CollectiveSpy
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, lm_loss
from tests.support.plan_measure import rank_tokens
from tests.support.parity import Parity, run_parity

NS, SGO, FS = ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD
PEAK_TOLERANCE = 0.05  # as tests/planning/test_plan.py: the allocator's profile against the replay

# The layouts chosen without activations (the one-call fully_shard form):
# root first, then the blocks in order.
EXPECTED = {
    ("lora", "roomy"): [NS] * 9,
    ("lora", "tight"): [SGO] + [FS] * 6 + [SGO] * 2,
    ("gpt", "roomy"): [NS] * 7,
    # The all-FULL_SHARD peak is the root's backward, where SHARD_GRAD_OP's
    # is the same (the bucket of every unit's gradients, reduced in place
    # through shared memory, no longer tops it: [Note: coalesced
    # reductions, planned]): every unit keeps its parameters gathered.
    ("gpt", "tight"): [SGO] * 7,
}


@pytest.mark.parametrize(("kind", "which"), list(EXPECTED))
def test_budget_chooses_the_cheapest_layouts_that_fit(kind: str, which: str) -> None:
    torch.manual_seed(0)
    model = MODELS[kind][0]()
    budget = budgets(model, kind)[which]
    chosen = budget_plan(model, kind, budget)
    assert [layout.strategy for layout in chosen.layouts] == EXPECTED[(kind, which)]
    assert [layout.name for layout in chosen.layouts] == [unit.name for unit in chosen.units]
    assert [unit.strategy for unit in chosen.units] == EXPECTED[(kind, which)]
    assert chosen.rank_bytes["total"] <= budget == chosen.memory_budget
    # One copy of the rules: the chosen plan is its layout policy's plan.
    policy = chosen.layout_policy()
    applied = cs.plan(model, world_size=2, policy=policy, strategy=policy.root_strategy, device="cpu")
    assert applied.rank_bytes == chosen.rank_bytes and applied.units == chosen.units
    table = str(chosen)
    assert f"layouts for a memory budget of {cs.planning.table.format_bytes(budget)} per rank" in table
    for layout in chosen.layouts:
        assert layout.reason in table


def test_roomy_lora_reduces_only_the_adapters() -> None:
    model = lora_stack()
    chosen = budget_plan(model, "lora", budgets(model, "lora")["roomy"])
    block = chosen.layouts[1]
    adapters = sum(p.numel() for p in model.blocks[0].parameters() if p.requires_grad)  # type: ignore[index]
    # One all-reduce of the adapters' fp32 gradients over 2 ranks: 2 * (2 - 1) / 2 of their bytes.
    assert block.strategy is NS and block.bytes_moved == adapters * 4 and block.collectives == 1
    assert block.reason == "fits replicated: no all-gather, gradients all-reduced"
    # Sharded, the frozen base would be gathered each step besides.
    tight = budget_plan(model, "lora", budgets(model, "lora")["tight"])
    assert tight.layouts[1].strategy is FS and tight.layouts[1].bytes_moved > 40 * block.bytes_moved
    assert tight.layouts[1].reason.startswith("sharded for the budget: ")


def test_a_frozen_unit_is_kept_gathered_and_moves_nothing() -> None:
    model = TinyGPT(n_blocks=2)
    model.blocks[1].requires_grad_(False)  # type: ignore[index]
    roomy = cs.plan(model, world_size=2, policy={Block}, strategy=NS, device="cpu").rank_bytes["total"]
    chosen = cs.plan(model, world_size=2, policy={Block}, device="cpu", memory_budget=roomy)
    frozen = chosen.layouts[2]
    assert (frozen.name, frozen.strategy, frozen.bytes_moved, frozen.collectives) == ("blocks.1", NS, 0, 0)
    assert frozen.reason == "fits replicated: frozen, kept gathered, moves nothing"


def test_strategy_caps_the_layouts_and_policy_strategies_are_kept() -> None:
    model = MODELS["gpt"][0]()
    tight = budgets(model, "gpt")["tight"]
    capped = cs.plan(model, world_size=2, policy={Block}, strategy=SGO, device="cpu", memory_budget=tight)
    assert {layout.strategy for layout in capped.layouts} <= {NS, SGO}
    with pytest.raises(ValueError, match=r"with every unit NO_SHARD, .*Raise the budget to at least \d+ bytes"):
        cs.plan(model, world_size=2, policy={Block}, strategy=NS, device="cpu", memory_budget=tight)
    fixed = CustomPolicy(lambda m: {"strategy": FS} if m is model.blocks[0] else isinstance(m, Block))  # type: ignore[index]
    chosen = cs.plan(model, world_size=2, policy=fixed, device="cpu", memory_budget=1 << 40)
    assert [(layout.strategy, layout.chosen) for layout in chosen.layouts[:3]] == [(NS, True), (FS, False), (NS, True)]
    assert chosen.layouts[1].reason == "fixed by the policy or an earlier fully_shard call"
    policy = chosen.layout_policy()
    assert "blocks.0" not in policy.layouts and policy.root_strategy is NS


class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize(
    ("budget", "kwargs", "error", "match"),
    [
        (-1, {}, ValueError, r"plan\(TinyGPT\): memory_budget must be a positive number of bytes per rank, got -1"),
        (0, {}, ValueError, r"memory_budget must be a positive number of bytes per rank, got 0"),
        (2.5e9, {}, TypeError, r"plan\(TinyGPT\): memory_budget must be an int number of bytes per rank, got float"),
        (True, {}, TypeError, r"memory_budget must be an int number of bytes per rank, got bool True"),
        ("8GiB", {}, TypeError, r"got str '8GiB'. Pass, for example, 8 \* 2\*\*30 for 8 GiB"),
        (
            1 << 40,
            {"strategy": ShardingStrategy.HYBRID_SHARD},
            ValueError,
            r"strategy=HYBRID_SHARD is not one of them. Pass strategy=FULL_SHARD",
        ),
        (
            1000,
            {},
            ValueError,
            r"plan\(TinyGPT\): memory_budget 1000 B \(1000 bytes\) per rank is below this model's peak on 2 ranks "
            r"with every unit FULL_SHARD, .* and with every unit at its cheapest layout, .*Raise the budget",
        ),
    ],
)
def test_plan_refuses_a_bad_budget_by_name(budget: object, kwargs: dict, error: type, match: str) -> None:
    model = TinyGPT()
    with pytest.raises(error, match=match):
        cs.plan(model, world_size=2, policy={Block}, memory_budget=budget, device="cpu", **kwargs)  # type: ignore[arg-type]
    assert cs.plan(model, world_size=2, policy={Block}, memory_budget=1 << 40, device="cpu").layouts  # still plannable


def test_layouts_need_a_budget_and_a_unit_with_parameters_and_the_same_model() -> None:
    with pytest.raises(ValueError, match=r"plan\(_NoParams\): memory_budget has no unit to lay out"):
        cs.plan(_NoParams(), world_size=2, memory_budget=1 << 30)
    model = TinyGPT(n_blocks=2)
    with pytest.raises(RuntimeError, match=r"layout_policy\(\): this plan chose no layouts. Call plan\(model"):
        cs.plan(model, world_size=2, policy={Block}).layout_policy()
    policy = cs.plan(model, world_size=2, policy={Block}, memory_budget=1 << 40, device="cpu").layout_policy()
    with pytest.raises(ValueError, match=r"LayoutPolicy: unit 'blocks.2' \(Block\) has no planned layout"):
        cs.plan(TinyGPT(n_blocks=3), world_size=2, policy=policy)
    with pytest.raises(ValueError, match=r"LayoutPolicy: planned units \['blocks.1'\] are not units of this model"):
        cs.plan(TinyGPT(n_blocks=1), world_size=2, policy=policy)
    with pytest.raises(TypeError, match=r"LayoutPolicy: the layout of 'blocks.0' is 'NO_SHARD'; give a ShardingStrategy"):
        LayoutPolicy({Block}, {"blocks.0": "NO_SHARD"})  # type: ignore[dict-item]
    assert cs.plan(model, world_size=2, policy=policy).units  # the right model plans


# ---------------------------------------------------------- distributed
def _measured_against_the_plan(rank: int, world_size: int) -> list[dict]:
    return [measure_budgeted(kind, which, rank, world_size) for kind in MODELS for which in ("roomy", "tight")]


@pytest.mark.parametrize("world_size", [2])
def test_budgeted_layouts_hold_what_the_plan_predicts(world_size: int) -> None:
    """Model state exact, the step's tensors within 5% of the plan's, for
    every chosen layout (with activations measured, as rank 0 chose)."""
    for records in run_distributed(_measured_against_the_plan, world_size, timeout=300):
        for record in records:  # type: ignore[union-attr]
            where = f"{record['kind']} {record['which']} rank {record['rank']}"
            assert record["built"] == record["layouts"], where
            assert record["rank_zero_total"] == record["chosen_total"] <= record["budget"], where
            if record["which"] == "roomy":
                assert set(record["layouts"].values()) == {"NO_SHARD"}, where
            else:
                assert {"FULL_SHARD", "SHARD_GRAD_OP"} & set(record["layouts"].values()), where
            _assert_held_as_planned(record, where)


def _assert_held_as_planned(record: dict, where: str) -> None:
    """Model state exact, the step's tensors within PEAK_TOLERANCE of the plan."""
    planned, allocated = record["planned"], record["allocated"]
    for key in ("params", "grads", "optimizer", "buffers"):
        assert planned[key] == allocated[key], f"{where}: planned {key} {planned[key]} != {allocated[key]}"
    tensors = planned["total"] - planned["transport"] - planned["runtime"]
    error = abs(tensors - allocated["peak"]) / allocated["peak"]
    assert error <= PEAK_TOLERANCE, (
        f"{where}: planned peak {tensors} vs measured {allocated['peak']} ({100 * error:.1f}% off, "
        f"worst moment {record['peak_moment']})"
    )


def _refused_then_trained(kind: str, which: str) -> None:
    build, unit = MODELS[kind]
    torch.manual_seed(0)
    budget = budgets(build(), kind)[which]
    expected = {layout.name: layout.strategy for layout in budget_plan(build(), kind, budget).layouts}
    assert [expected[name] for name in expected] == EXPECTED[(kind, which)]
    world = dist.group.WORLD
    bad: list[tuple[dict, type, str]] = [
        ({"memory_budget": -5}, ValueError,
         r"fully_shard\(TinyGPT\): memory_budget must be a positive int number of bytes per rank, got int -5"),
        ({"memory_budget": 1.0}, TypeError, r"memory_budget must be a positive int number of bytes per rank, got float"),
        ({"memory_budget": 1000}, ValueError, r"fully_shard\(TinyGPT\): choosing the layouts for memory_budget failed: "
         r"plan\(TinyGPT\): memory_budget 1000 B \(1000 bytes\) per rank is below this model's"),
        ({"memory_budget": budget, "strategy": ShardingStrategy.HYBRID_SHARD_ZERO2}, ValueError,
         r"fully_shard\(TinyGPT\): choosing .*strategy=HYBRID_SHARD_ZERO2 is not one of them"),
        ({"memory_budget": budget, "process_group": (world, world)}, ValueError,
         r"fully_shard\(TinyGPT\): memory_budget chooses among .* over one process group"),
    ]

    def shard(model: nn.Module) -> None:
        before = {name: param.shape for name, param in model.named_parameters()}
        for kwargs, error, match in bad:
            with pytest.raises(error, match=match):
                fully_shard(model, policy={unit}, **kwargs)
            assert not any(is_fully_sharded(m) for m in model.modules()), kwargs
            assert {name: param.shape for name, param in model.named_parameters()} == before, kwargs
        with pytest.raises(ValueError, match=r"fully_shard\((LoRA)?Block\+(LoRA)?Block\): memory_budget plans one module"):
            fully_shard([model.blocks[0], model.blocks[1]], memory_budget=budget)  # type: ignore[index]
        fully_shard(model, policy={unit}, memory_budget=budget)
        assert unit_strategies(model) == expected

    run_parity(Parity(build=build, shard=shard, steps=3))


def _budgeted_models_train_like_one_process(rank: int, world_size: int) -> None:
    for kind, which in EXPECTED:
        _refused_then_trained(kind, which)


@pytest.mark.parametrize("world_size", [2])
def test_budgeted_layouts_train_like_one_process(world_size: int) -> None:
    run_distributed(_budgeted_models_train_like_one_process, world_size, timeout=300)


# ------------------------------------------------- buckets given up last
def _budget_without_buckets() -> tuple[nn.Module, int, int]:
    """The GPT, the peak with every unit FULL_SHARD and its small units'
    collectives alone (the policy of a plan that gave the buckets up), and
    the same with them in buckets (higher)."""
    torch.manual_seed(0)
    model = MODELS["gpt"][0]()
    every_block = {f"blocks.{index}": FS for index in range(len(model.blocks))}  # type: ignore[arg-type]
    alone = LayoutPolicy({Block}, every_block, root_strategy=FS, coalesce=False)
    return model, cs.plan(model, world_size=2, policy=alone, device="cpu").rank_bytes["total"], uniform_peak(model, "gpt", FS)


def test_a_budget_held_only_without_buckets_turns_them_off() -> None:
    model, alone, coalesced = _budget_without_buckets()
    assert alone < coalesced, (alone, coalesced)
    chosen = budget_plan(model, "gpt", alone)
    assert not chosen.coalesced and chosen.bucket_bytes == 0 and chosen.rank_bytes["total"] <= alone
    assert "not coalesced: the budget holds the most sharded layouts only without buckets" in str(chosen)
    policy = chosen.layout_policy()
    assert policy.coalesce is False and policy.bucket_bytes == 0
    applied = cs.plan(model, world_size=2, policy=policy, strategy=policy.root_strategy, device="cpu")
    assert applied.rank_bytes == chosen.rank_bytes and not applied.coalesced
    roomy = budget_plan(model, "gpt", coalesced)
    assert roomy.coalesced and roomy.bucket_bytes is None
    assert roomy.layout_policy().coalesce is True and roomy.layout_policy().bucket_bytes is None
    assert "small units' all-gathers and reductions in buckets of up to 1 MiB" in str(roomy)
    with pytest.raises(ValueError, match=r"memory_budget .* is below this model's peak"):
        budget_plan(model, "gpt", alone - 1)


def _buckets_off_at_run_time(rank: int, world_size: int) -> None:
    """fully_shard with the budget above: no coalesced collective in a step,
    each unit's all-gathers and reductions alone; with the roomier budget
    they are coalesced."""
    for which in ("alone", "coalesced"):
        model, alone, coalesced = _budget_without_buckets()
        fully_shard(model, policy={Block}, memory_budget=alone if which == "alone" else coalesced)
        tokens = rank_tokens(rank, vocab=VOCAB)
        spy = CollectiveSpy()
        with spy.watching():
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        together = spy.counts()["all_gather_together"] + spy.counts()["reduce_grads_together"]
        assert (together == 0) == (which == "alone"), (which, spy.counts())
        assert spy.all_gathers_issued() > 0


def test_a_budget_held_only_without_buckets_runs_each_unit_alone() -> None:
    run_distributed(_buckets_off_at_run_time, 2)


# ------------------------------------------------- buckets given up by degrees
KIB = 1 << 10
SIZES: tuple[int | None, ...] = (None, 256 * KIB, 64 * KIB, 0)  # what a budget tries, in order


def _many_small_blocks() -> nn.Module:
    """24 blocks of 18.75 KiB and a root of about 50 KiB: at most a quarter
    of 256 KiB each, more than a quarter of 64 KiB, so the bucket size
    changes the peak at every step of SIZES."""
    torch.manual_seed(0)
    return TinyGPT(n_blocks=24, dim=48, vocab=VOCAB)


def _peaks_by_bucket(model: nn.Module) -> dict[int | None, int]:
    """The peak with every unit FULL_SHARD, per bucket size."""
    every_block = {f"blocks.{index}": FS for index in range(len(model.blocks))}  # type: ignore[arg-type]
    return {
        size: cs.plan(
            model,
            world_size=2,
            policy=LayoutPolicy({Block}, every_block, root_strategy=FS, bucket_bytes=size),
            device="cpu",
        ).rank_bytes["total"]
        for size in SIZES
    }


def test_a_budget_between_the_bucket_sizes_chooses_the_largest_that_fits() -> None:
    model = _many_small_blocks()
    peaks = _peaks_by_bucket(model)
    assert peaks[None] > peaks[256 * KIB] > peaks[64 * KIB] > peaks[0], peaks
    for size, budget, line in [
        (256 * KIB, peaks[256 * KIB], "in buckets of up to 256 KiB: the budget holds the most sharded layouts only"),
        (64 * KIB, peaks[256 * KIB] - 1, "in buckets of up to 64 KiB: the budget holds the most sharded layouts only"),
        (0, peaks[64 * KIB] - 1, "not coalesced: the budget holds the most sharded layouts only without buckets"),
    ]:
        chosen = budget_plan(model, "gpt", budget)
        assert (chosen.bucket_bytes, chosen.coalesced) == (size, size != 0), (budget, chosen.bucket_bytes)
        assert chosen.rank_bytes["total"] <= budget
        assert f"small units' all-gathers and reductions {line}" in str(chosen) if size else line in str(chosen)
        policy = chosen.layout_policy()
        assert (policy.bucket_bytes, policy.coalesce) == (size, size != 0)
        applied = cs.plan(model, world_size=2, policy=policy, strategy=policy.root_strategy, device="cpu")
        assert applied.rank_bytes == chosen.rank_bytes and applied.units == chosen.units
        assert (applied.bucket_bytes, applied.layouts) == (size, [])
    with pytest.raises(ValueError, match=r"memory_budget .* is below this model's peak"):
        budget_plan(model, "gpt", peaks[0] - 1)


def test_a_bucket_size_no_unit_joins_is_skipped() -> None:
    """The GPT's units are all over 64 KiB: with buckets of 64 KiB none
    joins one, its plan is the plan without buckets, and a budget that
    holds only that one says "not coalesced" (not 64 KiB)."""
    model = MODELS["gpt"][0]()
    peaks = _peaks_by_bucket(model)
    units = cs.plan(model, world_size=2, policy={Block}, device="cpu").units
    assert not any(u.bucket_key(64 * KIB) or u.gather_key(64 * KIB) for u in units)
    assert any(u.bucket_key(256 * KIB) for u in units)  # 256 KiB is tried
    assert peaks[256 * KIB] > peaks[64 * KIB] == peaks[0], peaks
    chosen = budget_plan(model, "gpt", peaks[0])
    assert (chosen.bucket_bytes, chosen.coalesced) == (0, False)
    assert "not coalesced: the budget holds the most sharded layouts only without buckets" in str(chosen)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bucket_bytes": -1}, ValueError, r"LayoutPolicy: bucket_bytes must be at least 0, got -1\. Pass"),
        (
            {"bucket_bytes": 2.5e5},
            TypeError,
            r"LayoutPolicy: bucket_bytes must be None or an int number of bytes, "
            r"got float 250000.0\. Pass, for example, 256 \* 2\*\*10",
        ),
        ({"bucket_bytes": True}, TypeError, r"LayoutPolicy: bucket_bytes must be None or an int .*got bool True"),
        ({"bucket_bytes": "1MiB"}, TypeError, r"LayoutPolicy: bucket_bytes .*got str '1MiB'"),
        (
            {"coalesce": False, "bucket_bytes": 4096},
            ValueError,
            r"LayoutPolicy: coalesce=False means no buckets, but bucket_bytes=4096\. Pass one of the two",
        ),
        ({"coalesce": 0}, TypeError, r"LayoutPolicy: coalesce must be a bool, got int 0"),
    ],
)
def test_layout_policy_refuses_a_bad_bucket_size_by_name(kwargs: dict, error: type, match: str) -> None:
    model = TinyGPT(n_blocks=2)
    layouts = {"blocks.0": FS, "blocks.1": FS}
    with pytest.raises(error, match=match):
        LayoutPolicy({Block}, layouts, **kwargs)
    for good, size in [({}, None), ({"coalesce": False}, 0), ({"bucket_bytes": 0}, 0), ({"bucket_bytes": 4096}, 4096)]:
        policy = LayoutPolicy({Block}, layouts, **good)
        assert (policy.bucket_bytes, policy.coalesce) == (size, size != 0)
        assert cs.plan(model, world_size=2, policy=policy, device="cpu").bucket_bytes == size  # still plans


def _expected_gathers(states: list[UnitState], bucket: int) -> tuple[int, int]:
    """(coalesced, alone) all-gathers of one pass over ``states`` (in the
    pass's order, each needing its all-gather) by the rule of [Note:
    coalesced all-gathers]: a unit at most a quarter of ``bucket`` leads
    one, and the next units that are as small join while the bucket holds
    them; a bucket of one unit is an all-gather alone."""
    sizes = [
        sum(handle.unsharded_flat_param.numel() * handle.param_dtype.itemsize for handle in state.handles)
        for state in states
    ]
    together = alone = index = 0
    while index < len(sizes):
        members, total = 1, sizes[index]
        if total <= bucket // 4:
            while (
                index + members < len(sizes)
                and sizes[index + members] <= bucket // 4
                and total + sizes[index + members] <= bucket
            ):
                total += sizes[index + members]
                members += 1
        together, alone = (together + 1, alone) if members > 1 else (together, alone + 1)
        index += members
    return together, alone


def _intermediate_buckets_at_run_time(rank: int, world_size: int) -> None:
    """fully_shard with a budget that holds the layouts with 256 KiB
    buckets but not 1 MiB ones: every forward issues the coalesced
    all-gathers 256 KiB buckets make of the units (not the one bucket of
    1 MiB), every backward those of the units it gathers again, and the
    model trains like one process."""
    budget = _peaks_by_bucket(_many_small_blocks())[256 * KIB]
    expected = budget_plan(_many_small_blocks(), "gpt", budget)
    assert expected.bucket_bytes == 256 * KIB
    counts: list[tuple[tuple[int, int], tuple[int, int]]] = []
    passes: list[tuple[tuple[int, int], tuple[int, int]]] = []

    def shard(model: nn.Module) -> None:
        fully_shard(model, policy={Block}, memory_budget=budget)
        assert unit_strategies(model) == {layout.name: layout.strategy for layout in expected.layouts}
        assert cs.describe(model).bucket_bytes == 256 * KIB  # the root keeps the chosen size
        states = [state for _, state in unit_states_under(model)]
        assert all(h.groups.is_sharded for state in states for h in state.handles)
        # Backward gathers again the units resharded after forward, in
        # reverse: not the root, which stays gathered for it.
        again = [state for state in states[1:] if state.config.strategy.reshards_after_forward][::-1]
        passes.append((_expected_gathers(states, 256 * KIB), _expected_gathers(again, 256 * KIB)))
        assert _expected_gathers(states, 1 << 20) == (1, 0)  # what the default bucket would issue

    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        forward, backward = CollectiveSpy(), CollectiveSpy()
        with forward.watching():
            loss = lm_loss(model(inputs), targets)
        with backward.watching():
            loss.backward()
        # (buckets, units gathered alone)
        counts.append(
            tuple(  # type: ignore[arg-type]
                (
                    spy.counts()["all_gather_together"],
                    spy.all_gathers_issued() - spy.counts()["all_gather_together"],
                )
                for spy in (forward, backward)
            )
        )
        return loss.detach()

    run_parity(Parity(build=_many_small_blocks, shard=shard, step_fn=step, steps=3))
    assert passes[0][0][0] >= 2, passes  # several buckets of 256 KiB per forward
    for index, count in enumerate(counts):
        assert count == passes[0], (index, count, passes[0])


def test_a_budget_between_bucket_sizes_coalesces_in_the_chosen_size_at_run_time() -> None:
    run_distributed(_intermediate_buckets_at_run_time, 2, timeout=300)


# ------------------------------------------------- buckets grown with room to spare
MIB = 1 << 20


def _wide_small_blocks() -> nn.Module:
    """24 blocks of about 50 KiB (1.2 MiB in all): 1 MiB buckets hold them
    in several collectives per pass, 4 MiB ones in one, 16 MiB ones in no
    fewer."""
    torch.manual_seed(0)
    return TinyGPT(n_blocks=24, dim=128, vocab=VOCAB)


def _blocks_fully_sharded(model: nn.Module) -> CustomPolicy:
    """Every block FULL_SHARD by the policy: the budget chooses the root's
    layout and the buckets."""
    return CustomPolicy(lambda module: {"strategy": FS} if isinstance(module, Block) else False)


def _grown_plan(model: nn.Module, budget: int) -> cs.ShardingPlan:
    return cs.plan(
        model, world_size=2, policy=_blocks_fully_sharded(model), device="cpu", memory_budget=budget,
        input_shape=(BATCH, SEQ),
    )


def test_a_budget_with_room_to_spare_takes_larger_buckets_that_save_collectives() -> None:
    model = _wide_small_blocks()
    roomy = _grown_plan(model, 1 << 40)
    # 16 MiB coalesces no more than 4 MiB: the smaller of the two.
    assert roomy.bucket_bytes == 4 * MIB and roomy.coalesced
    assert "in buckets of up to 4 MiB: the budget holds these layouts with buckets larger than " \
        "composable_shard.comm's (1 MiB), so fewer collectives" in str(roomy)
    policy = roomy.layout_policy()
    assert policy.bucket_bytes == 4 * MIB
    applied = cs.plan(
        model, world_size=2, policy=policy, strategy=policy.root_strategy, device="cpu", input_shape=(BATCH, SEQ)
    )
    assert applied.rank_bytes == roomy.rank_bytes and applied.units == roomy.units
    # The same layouts with the default buckets peak lower: a budget one
    # byte short of the larger buckets' peak keeps the defaults, and the layouts.
    short = _grown_plan(model, roomy.rank_bytes["total"] - 1)
    assert short.bucket_bytes is None, short.bucket_bytes
    assert [layout.strategy for layout in short.layouts] == [layout.strategy for layout in roomy.layouts]
    assert short.rank_bytes["total"] < roomy.rank_bytes["total"]
    assert "in buckets of up to 1 MiB" in str(short)
    # Units that one default bucket holds already gain nothing from larger ones.
    assert budget_plan(_many_small_blocks(), "gpt", 1 << 40).bucket_bytes is None


def _grown_buckets_at_run_time(rank: int, world_size: int) -> None:
    """fully_shard with a roomy budget: every forward gathers the 24 blocks
    in the collectives 4 MiB buckets make (one), not 1 MiB's; the model
    trains like one process, and holds what the plan predicts."""
    chosen = _grown_plan(_wide_small_blocks(), 1 << 40)
    assert chosen.bucket_bytes == 4 * MIB
    counts: list[int] = []
    expected: list[tuple[int, int]] = []

    def shard(model: nn.Module) -> None:
        fully_shard(model, policy=_blocks_fully_sharded(model), memory_budget=1 << 40)
        assert cs.describe(model).bucket_bytes == 4 * MIB
        blocks = [state for name, state in unit_states_under(model) if name]
        expected.append(_expected_gathers(blocks, 4 * MIB))
        assert expected[0] == (1, 0) and _expected_gathers(blocks, MIB)[0] > 1, expected

    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        spy = CollectiveSpy()
        with spy.watching():
            loss = lm_loss(model(inputs), targets)
        counts.append(spy.counts()["all_gather_together"])
        loss.backward()
        return loss.detach()

    run_parity(Parity(build=_wide_small_blocks, shard=shard, step_fn=step, steps=3))
    assert counts == [expected[0][0]] * 3, counts
    record = measure_chosen(_wide_small_blocks(), chosen, rank, world_size)
    assert record["built"] == record["layouts"] and record["rank_zero_total"] == record["chosen_total"]
    _assert_held_as_planned(record, f"4 MiB buckets rank {rank}")


def test_larger_buckets_a_budget_chose_coalesce_and_train_like_one_process() -> None:
    run_distributed(_grown_buckets_at_run_time, 2, timeout=300)
