"""Owns: the models and budgets of the budgeted-layout tests (a LoRA stack
with a frozen base, a GPT) and measuring a budgeted model's allocated bytes
and step peak beside its plan.

Knows nothing of: how the plan chooses layouts (it calls
``composable_shard.plan`` and ``fully_shard``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch
import torch.nn as nn

import composable_shard as cs
from composable_shard import ShardingStrategy
from composable_shard.runtime.state import unit_states_under

from .models import Block, LoRABlock, TinyGPT, lm_loss
from .plan_measure import cpu_peak_above_start, kept_between_steps, rank_tokens, state_bytes

# Wide enough that sharding a unit saves more than the shared-memory slots
# the first sharded unit costs; the activations' input.
DIM, VOCAB, BATCH, SEQ = 256, 256, 2, 6


def lora_stack() -> nn.Module:
    """Frozen base Linear layers with trainable rank-2 adapters (LoRABlock)
    under a trainable embedding and head: the bench's LoRA shape, small."""
    model = TinyGPT(n_blocks=0, dim=DIM, vocab=VOCAB)
    model.blocks = nn.ModuleList([LoRABlock(DIM) for _ in range(8)])
    return model


def gpt_stack() -> nn.Module:
    return TinyGPT(n_blocks=6, dim=192, vocab=VOCAB)


# name -> (builder, the policy's unit class)
MODELS: dict[str, tuple[Callable[[], nn.Module], type[nn.Module]]] = {
    "lora": (lora_stack, LoRABlock),
    "gpt": (gpt_stack, Block),
}


def uniform_peak(model: nn.Module, kind: str, strategy: ShardingStrategy, **plan_kwargs: Any) -> int:
    """The predicted peak with every unit ``strategy``."""
    unit = MODELS[kind][1]
    return cs.plan(model, world_size=2, policy={unit}, strategy=strategy, device="cpu", **plan_kwargs).rank_bytes[
        "total"
    ]


def budgets(model: nn.Module, kind: str, **plan_kwargs: Any) -> dict[str, int]:
    """``roomy``: the peak with every unit replicated (NO_SHARD fits it);
    ``tight``: the peak with every unit FULL_SHARD."""
    return {
        "roomy": uniform_peak(model, kind, ShardingStrategy.NO_SHARD, **plan_kwargs),
        "tight": uniform_peak(model, kind, ShardingStrategy.FULL_SHARD, **plan_kwargs),
    }


def budget_plan(model: nn.Module, kind: str, budget: int, **plan_kwargs: Any) -> Any:
    unit = MODELS[kind][1]
    return cs.plan(model, world_size=2, policy={unit}, memory_budget=budget, device="cpu", **plan_kwargs)


def unit_strategies(model: nn.Module) -> dict[str, ShardingStrategy]:
    """Each unit's strategy as fully_shard built it, by unit name."""
    return {name: state.config.strategy for name, state in unit_states_under(model)}


def measure_budgeted(kind: str, which: str, rank: int, world_size: int) -> dict[str, Any]:
    """Plan ``kind`` for budget ``which`` (with activations, as rank 0),
    shard it with the plan's ``layout_policy()``, train a step, and return
    the plan beside what the allocator holds on this rank."""
    build = MODELS[kind][0]
    torch.manual_seed(0)
    model = build()
    inputs = {"input_shape": (BATCH, SEQ)}
    budget = budgets(model, kind, **inputs)[which]
    chosen = budget_plan(model, kind, budget, **inputs)
    return {"kind": kind, "which": which, **measure_chosen(model, chosen, rank, world_size)}


def measure_chosen(model: nn.Module, chosen: Any, rank: int, world_size: int) -> dict[str, Any]:
    """Shard ``model`` with budgeted plan ``chosen``'s ``layout_policy()``
    (planned with activations of (BATCH, SEQ) tokens, as rank 0), train a
    step, and return the plan beside what the allocator holds on this rank."""
    inputs = {"input_shape": (BATCH, SEQ)}
    budget = chosen.memory_budget
    policy = chosen.layout_policy()
    on_this_rank = cs.plan(
        model, world_size=world_size, rank=rank, policy=policy, strategy=policy.root_strategy, device="cpu", **inputs
    )
    as_rank_zero = cs.plan(model, world_size=world_size, policy=policy, strategy=policy.root_strategy, device="cpu",
                           **inputs)
    cs.fully_shard(model, policy=policy, strategy=policy.root_strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = rank_tokens(rank, vocab=VOCAB)

    def step() -> None:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()

    optimizer.zero_grad(set_to_none=True)
    step()
    allocated = state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()  # see plan_measure.measure_case: no collection inside the measured step
    gc.disable()
    try:
        allocated["peak"] = kept_between_steps(allocated) + cpu_peak_above_start(step)
    finally:
        gc.enable()
    return {
        "rank": rank,
        "budget": budget,
        "layouts": {layout.name: layout.strategy.name for layout in chosen.layouts},
        "built": {name: strategy.name for name, strategy in unit_strategies(model).items()},
        "chosen_total": chosen.rank_bytes["total"],
        "rank_zero_total": as_rank_zero.rank_bytes["total"],
        "planned": dict(on_this_rank.rank_bytes),
        "allocated": allocated,
        "peak_moment": on_this_rank.peak_moment,
    }
