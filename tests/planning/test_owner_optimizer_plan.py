"""The plan of optimizers stepped whole on owner ranks ("muon", "adafactor",
("owner", k)): the runtime's owners, the state each owner keeps whole —
exactly what torch's Muon (with AdamW on the rest), Adafactor and a user's
own optimizer allocate — and ``optimizer.step()``'s transients (whole
values and gradients, the exchange's buffers, the optimizer's own
temporaries) against the CPU allocator, under FULL_SHARD on 2 and 4 ranks
(real gloo groups; PyTorch's fake process group refuses the exchange's
all_to_all where a rank sends nothing). [Note: owner-stepped optimizers, planned] in
composable_shard/planning/owner_memory.py."""

from __future__ import annotations


import pytest
import torch

import composable_shard as cs
from composable_shard.planning.owner_memory import OwnerOptimizer, owner_state_bytes

from tests.support.comm_spies import gloo_only_group, shared_memory_switched_off
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT
from tests.support.plan_measure import OWNER_CASES, _wide_gpt, measure_owner_case

# optimizer.step()'s transient bytes are the plan's, in fresh or warm workers
# and in any test order. They once came out up to 1.6x the plan in the
# suite's warm workers: gloo's worker thread dropped its references to the
# exchange's buffers after wait() returned, at a moment the scheduler chose
# (more often on a busy machine), so the buffers outlived their use; the
# exchange now frees them itself ([Note: the exchange frees its buffers
# itself] in composable_shard/optim/owner_step.py). What the plan leaves out,
# so what the measurement may add: scalars of a few bytes the optimizers make
# (norms, means, clamps; measured: 0 or 16 B alive at once) ...
SCALAR_BYTES = 512
# ... and, for Muon, the matrix products' own workspace (oneDNN's packed bf16
# operands: measured in the same process by newton_schulz_scratch, without
# composable_shard; all of it shows on the rank whose step peaks inside
# Newton-Schulz, none on the others).
# The whole step's peak (forward, backward, step) likewise: the plan's, plus
# at most those scalars and Muon's workspace. Measured at 2 ranks, through
# shared memory and through gloo's messages alike: equal to the plan (its
# worst moment the root's backward), but on the rank whose peak is Muon's
# step, above it by that rank's workspace less 4 B.


def _check_owner_record(record: dict, *, whole_step_peak: bool = True) -> None:
    """State exact by kind, plan == describe, the plan's owners the
    runtime's; the step's transients and the whole step's peak what the
    plan counts, plus at most the scalars and Muon's matrix workspace."""
    where = f"{record['case']} rank {record['rank']}/{record['world_size']}"
    allocated, planned, described = record["allocated"], record["planned"], record["described"]
    for key in ("params", "grads", "optimizer", "buffers"):
        assert planned[key] == allocated[key], f"{where}: planned {key} {planned[key]} != allocated {allocated[key]}"
        assert described[key] == allocated[key], f"{where}: described {key} {described[key]} != allocated {allocated[key]}"
    if record["case"] != "owner:owner":  # a user's optimizer names its own state
        by_kind = {kind: size for kind, size in record["optimizer_by_kind"].items() if size}
        allocated_by_kind = {kind: size for kind, size in record["allocated_by_kind"].items() if size}
        assert by_kind == allocated_by_kind, f"{where}: {by_kind} != {allocated_by_kind}"
    assert record["plan_table"] == record["describe_table"], f"{where}: plan and describe tables differ"
    assert record["planned_owners"] == record["runtime_owners"], f"{where}: the plan's owners are not the runtime's"
    step_planned, step_measured = record["step_planned"], record["step_measured"]
    slack = record["scratch"] + SCALAR_BYTES
    assert step_planned <= step_measured <= step_planned + slack, (
        f"{where}: optimizer.step() planned {step_planned} B, measured {step_measured} B "
        f"({step_measured - step_planned:+d} B; allowed: 0 to {slack} B of scalars and matrix-product workspace)"
    )
    if not whole_step_peak:
        return
    tensors = planned["total"] - planned["transport"] - planned["runtime"]
    assert tensors <= allocated["peak"] <= tensors + slack, (
        f"{where}: planned peak {tensors} vs measured {allocated['peak']} ({allocated['peak'] - tensors:+d} B; "
        f"allowed: 0 to {slack} B of scalars and matrix-product workspace; worst moment {record['peak_moment']})"
    )


def _measure_owner_cases(rank: int, world_size: int) -> list[dict]:
    return [measure_owner_case(name, rank, world_size) for name in OWNER_CASES]


@pytest.mark.parametrize("world_size", [2, 4])
def test_owner_optimizer_plan_equals_allocated_bytes_with_gloo(world_size: int) -> None:
    results = run_distributed(_measure_owner_cases, world_size, timeout=300)
    records = [record for records in results for record in records]  # type: ignore[union-attr]
    for record in records:
        _check_owner_record(record)
    # Whole parameters live on one rank each: the ranks' Muon buffers add up
    # to the 2-D parameters, Adafactor's steps to one per parameter.
    model = _wide_gpt()
    muon = sum(r["allocated_by_kind"]["momentum_buffer"] for r in records if r["case"] == "owner:muon")
    assert muon == sum(4 * p.numel() for p in model.parameters() if p.ndim == 2)
    steps = sum(r["allocated_by_kind"]["step"] for r in records if r["case"] == "owner:adafactor")
    assert steps == 4 * len(list(model.parameters()))
    # Pieces moved to owners: the exchange ran (and was planned) in every case.
    assert all(any(r["sent_to_owners"] for r in records if r["case"] == f"owner:{name}") for name in OWNER_CASES)


def _measure_owner_cases_through_buffers(rank: int, world_size: int, hold: bool = False) -> list[dict]:
    """The cases on a group made with the shared memory switched off, whose
    exchange goes through send and receive buffers (gloo's messages), the
    plan made likewise; ``hold``: every tensor given to the collectives kept
    referenced (``holding_collective_tensors``)."""
    import torch.distributed as dist

    from composable_shard import comm

    group = gloo_only_group(world_size)
    try:
        assert not comm.all_to_all_in_place(torch.device("cpu"), group)
        with shared_memory_switched_off():  # the plans too
            return [
                measure_owner_case(name, rank, world_size, process_group=group, hold_collective_tensors=hold)
                for name in OWNER_CASES
            ]
    finally:
        dist.destroy_process_group(group)

def test_owner_optimizer_plan_equals_allocated_bytes_through_buffers() -> None:
    """[Note: the exchange in place] is the shared memory's; elsewhere the
    exchange's send and receive buffers are what the plan counts: state and
    optimizer.step()'s transients and the whole step's peak as above (it
    was once 13.5% over the plan at the root's backward, while gloo's worker
    thread held buffers the runtime had let go: comm now frees them at the
    wait, ``comm.FreedAtWait``)."""
    results = run_distributed(_measure_owner_cases_through_buffers, 2, timeout=300)
    for records in results:
        for record in records:  # type: ignore[union-attr]
            _check_owner_record(record)


def test_owner_step_transients_do_not_wait_for_the_collectives_to_let_go() -> None:
    """[Note: the exchange frees its buffers itself]: through gloo's
    messages (the exchange's buffers), with every tensor the step gives its
    collectives still referenced after they return (as gloo's worker thread
    may hold them, for as long as the scheduler decides), optimizer.step()
    allocates what the plan counts. (Through shared memory the exchange has
    no buffer to hold: [Note: the exchange in place].)"""
    results = run_distributed(_measure_owner_cases_through_buffers, 2, True, timeout=300)
    for records in results:
        for record in records:  # type: ignore[union-attr]
            _check_owner_record(record, whole_step_peak=False)


def test_owner_state_is_whole_on_one_rank_per_parameter() -> None:
    """Summed over ranks, the planned state is the whole optimizer's state of
    one process: Muon's buffers over the 2-D parameters (AdamW's over the
    rest of the shards), Adafactor's factors, k tensors per parameter."""
    model = TinyGPT(n_blocks=2, dim=32, vocab=64)
    world = 4
    plans = {
        name: [cs.plan(model, world_size=world, rank=r, policy={Block}, optimizer=spec, device="cpu") for r in range(world)]
        for name, spec in (("muon", "muon"), ("adafactor", "adafactor"), ("owner", ("owner", 3)))
    }
    params = list(model.parameters())
    muon = [p.optimizer_by_kind for p in plans["muon"]]
    assert sum(k["momentum_buffer"] for k in muon) == sum(4 * p.numel() for p in params if p.ndim == 2)
    assert sum(k["exp_avg"] for k in muon) == sum(4 * p.numel() for p in params if p.ndim != 2)
    factors = sum(sum(k.values()) for k in (p.optimizer_by_kind for p in plans["adafactor"]))
    assert factors == sum(4 * (p.shape[0] + p.shape[1] if p.ndim == 2 else p.numel()) + 4 for p in params)
    assert sum(p.rank_bytes["optimizer"] for p in plans["owner"]) == sum(3 * 4 * p.numel() for p in params)
    assert [p.optimizer for p in plans["owner"]] == ["owner x3"] * world
    assert "optimizer state (muon)" in str(plans["muon"][0]) and "momentum_buffer" in str(plans["muon"][0])


def test_owners_in_the_plan_are_the_runtime_rule_on_the_plan_layouts() -> None:
    """A parameter wholly inside one rank's shard is owned there (no state
    elsewhere); one rank owning every whole parameter of a one-rank group."""
    model = TinyGPT(n_blocks=1, dim=32, vocab=64)
    single = cs.plan(model, world_size=1, policy={Block}, optimizer="adafactor", device="cpu")
    assert sum(single.optimizer_by_kind.values()) == sum(
        4 * (p.shape[0] + p.shape[1] if p.ndim == 2 else p.numel()) + 4 for p in model.parameters()
    )
    no_shard = [
        cs.plan(model, world_size=2, rank=r, policy={Block}, optimizer=("owner", 1), device="cpu",
                strategy=cs.ShardingStrategy.NO_SHARD)
        for r in range(2)
    ]
    # NO_SHARD: every rank holds (and owns) every whole parameter, nothing moves.
    assert [p.rank_bytes["optimizer"] for p in no_shard] == [4 * sum(p.numel() for p in model.parameters())] * 2
    unit_bytes = cs.plan(model, world_size=2, policy={Block}, optimizer=("owner", 0), device="cpu")
    assert unit_bytes.rank_bytes["optimizer"] == 0
    assert owner_state_bytes(unit_bytes.units, OwnerOptimizer("owner", 0)) == {"state": 0}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": "shampoo"}, ValueError, r"plan\(TinyGPT\): optimizer 'shampoo' is unknown; pick one of \['adafactor', "
         r"'adam', 'adamw', 'muon', 'sgd'\], or \('owner', k\)"),
        ({"optimizer": ("owner", -1)}, ValueError, r"optimizer \('owner', -1\) is unknown"),
        ({"optimizer": ("owner", 1.5)}, ValueError, r"optimizer \('owner', 1.5\) is unknown"),
        (
            {"optimizer": "muon", "optimizer_in_backward": True},
            ValueError,
            r"plan\(TinyGPT\): optimizer 'muon' with optimizer_in_backward=True: the plan does not model owner-stepped "
            r"optimizers stepped in backward hooks yet",
        ),
    ],
)
def test_plan_rejects_bad_owner_optimizers_by_name(kwargs: dict, error: type, match: str) -> None:
    model = TinyGPT()
    with pytest.raises(error, match=match):
        cs.plan(model, world_size=2, **kwargs)
    assert cs.plan(model, world_size=2, optimizer="muon").rank_bytes["optimizer"] > 0  # still plannable


def _describe_refuses_owner_optimizer_in_backward(rank: int, world_size: int) -> None:
    model = TinyGPT()
    cs.fully_shard(model, policy={Block})
    with pytest.raises(ValueError, match=r"describe\(TinyGPT\): optimizer 'adafactor' with optimizer_in_backward=True"):
        cs.describe(model, optimizer="adafactor", optimizer_in_backward=True)
    assert cs.describe(model, optimizer="adafactor").rank_bytes["optimizer"] > 0
    with pytest.raises(ValueError, match=r"describe\(TinyGPT\): optimizer 'lamb' is unknown"):
        cs.describe(model, optimizer="lamb")


def test_describe_rejects_bad_owner_optimizers_by_name() -> None:
    run_distributed(_describe_refuses_owner_optimizer_in_backward, 2)
