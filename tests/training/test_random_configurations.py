"""Parity with one process for configurations drawn at random (fixed seeds)
from the features users combine: how units are chosen (per block, inside
an activation-checkpoint wrapper, groups, ``SmallUnitGroups``, the root
alone), a strategy per unit, bucket sizes, the per-unit runtime controls,
prefetching, gradient accumulation (``no_sync`` or
``set_requires_gradient_sync``), clipping, state-dict round trips,
evaluation forwards between steps, sequence lengths that change, a block run
twice, two forwards before one backward, and a block some steps leave out
(only where it is a unit of its own: inside a larger unit it gets zeros,
not None, [Note: parameters a backward leaves without a gradient]). Each
seed is one configuration; a failure prints it, so it can be replayed with
``_run_configuration(rank, world_size, draw(seed, world_size))``.

A throwaway run of the same draws over about 740 configurations (2 and 4
ranks) found that last difference and nothing else: 5 failures, each a
block skipped inside a larger unit (the root alone, a pair, a small-unit
group) under Adam, AdamW or SGD with momentum."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn as nn

import composable_shard as cs
from composable_shard import BackwardPrefetch, ShardingStrategy, StateDictOptions

from tests.support.comm_spies import gather_bucket_bytes, reduce_bucket_bytes
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, LoRAGPT, TinyGPT, lm_loss
from tests.support.parity import Parity, hybrid_groups, run_parity

_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
_HYBRID = ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


def draw(seed: int, world_size: int) -> dict[str, Any]:
    """One configuration, the same on every rank."""
    r = random.Random(seed)
    strategies = _STRATEGIES + (_HYBRID if world_size == 4 else [])
    selection = r.choice(["per_block", "per_block", "inner", "pairs", "small_groups", "root_only"])
    return dict(
        n_blocks=r.choice([2, 3, 4]),
        model=r.choice(["tiny", "tiny", "lora", "odd"]),
        selection=selection,
        strategies=[r.choice(strategies) for _ in range(4)],
        root_strategy=r.choice(strategies),
        checkpointing=r.choice(["none", "none", "every", "alternate"]),
        gather_bucket=r.choice([0, 1 << 10, 1 << 20]),
        reduce_bucket=r.choice([0, 1 << 10, 1 << 20]),
        optimizer=r.choice(["sgd", "adamw", "adam"]),
        optimizer_before_shard=r.random() < 0.3,
        micro=r.choice([1, 1, 2]),
        accumulate_with=r.choice(["no_sync", "set_sync"]),
        reshard_after_forward=[r.choice([None, None, False, True]) for _ in range(4)],
        reshard_after_backward=[r.choice([None, None, None, False]) for _ in range(4)],
        forward_prefetch=r.random() < 0.3,
        backward_prefetch=r.choice(["BACKWARD_PRE", "BACKWARD_POST", None]),
        explicit_prefetch=r.random() < 0.3,
        limit_all_gathers=r.random() < 0.8,
        clip=r.random() < 0.3,
        state_dict_round_trip=r.choice([None, None, "full", "sharded"]),
        eval_between=r.random() < 0.3,
        varlen=r.random() < 0.2,
        block_twice=r.random() < 0.2,
        two_forwards=r.random() < 0.2,
        skip_last=r.random() < 0.2 and selection in ("per_block", "inner"),
    )


class DrawnGPT(TinyGPT):
    """TinyGPT whose first block may run twice and whose last block the
    step may leave out."""

    def __init__(self, n_blocks: int, block_twice: bool, odd: bool) -> None:
        super().__init__(n_blocks=n_blocks)
        if odd:  # hidden widths that do not divide by the world size
            self.blocks = nn.ModuleList([Block(hidden=37 + i) for i in range(n_blocks)])
        self.block_twice = block_twice
        self.skip_last = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        blocks = list(self.blocks)[: -1 if self.skip_last else None]
        for block in blocks[:1] * self.block_twice + blocks:
            x = block(x)
        return self.head(self.norm(x))


def _run_configuration(rank: int, world_size: int, config: dict[str, Any]) -> None:
    with gather_bucket_bytes(config["gather_bucket"]), reduce_bucket_bytes(config["reduce_bucket"]):
        run_parity(_parity(world_size, config))


def _parity(world_size: int, config: dict[str, Any]) -> Parity:
    groups = hybrid_groups(world_size) if world_size == 4 else None
    micro = config["micro"]
    steps_taken: dict[int, int] = {}

    def build() -> nn.Module:
        if config["model"] == "lora":
            model: nn.Module = LoRAGPT(n_blocks=config["n_blocks"])
        else:
            model = DrawnGPT(config["n_blocks"], config["block_twice"], odd=config["model"] == "odd")
        if config["checkpointing"] != "none":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, block in enumerate(list(model.blocks)):
                if config["checkpointing"] == "every" or i % 2 == 0:
                    model.blocks[i] = checkpoint_wrapper(block)
        return model

    def options(strategy: str) -> dict[str, Any]:
        prefetch = config["backward_prefetch"]
        kwargs: dict[str, Any] = dict(
            strategy=ShardingStrategy[strategy],
            forward_prefetch=config["forward_prefetch"],
            backward_prefetch=None if prefetch is None else BackwardPrefetch[prefetch],
            limit_all_gathers=config["limit_all_gathers"],
        )
        if strategy.startswith("HYBRID"):
            kwargs["process_group"] = groups
        return kwargs

    def shard(model: nn.Module) -> None:
        blocks = list(model.blocks)
        selection = config["selection"]
        if selection == "small_groups":
            cs.fully_shard(model, policy=cs.SmallUnitGroups({Block}, max_bytes=30000), **options(config["root_strategy"]))
            return
        units: list[nn.Module] = []
        if selection in ("per_block", "inner"):
            for i, block in enumerate(blocks):
                unit = getattr(block, "_checkpoint_wrapped_module", block) if selection == "inner" else block
                cs.fully_shard(unit, **options(config["strategies"][i]))
                units.append(unit)
        elif selection == "pairs":
            for i in range(0, len(blocks), 2):
                pair = blocks[i : i + 2]
                cs.fully_shard(pair if len(pair) > 1 else pair[0], **options(config["strategies"][i]))
                units.append(pair[0])
        cs.fully_shard(model, **options(config["root_strategy"]))
        for unit, after_forward, after_backward in zip(
            units, config["reshard_after_forward"], config["reshard_after_backward"]
        ):
            if after_forward is not None:
                cs.set_reshard_after_forward(unit, after_forward)
            if after_backward is not None:
                cs.set_reshard_after_backward(unit, after_backward)
        if config["explicit_prefetch"] and len(units) > 2:
            for earlier, later in zip(units, units[1:]):
                cs.set_modules_to_forward_prefetch(earlier, [later])
                cs.set_modules_to_backward_prefetch(later, [earlier])

    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if config["optimizer"] == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        elif config["optimizer"] == "adam":
            optimizer = torch.optim.Adam(params, lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if config["clip"]:
            def clip(*_: object) -> None:
                if cs.is_fully_sharded(model):
                    cs.clip_grad_norm_(model, 0.05)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

            optimizer.register_step_pre_hook(clip)
        return optimizer

    def prepare(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = steps_taken.get(id(model), 0)
        steps_taken[id(model)] = step + 1
        if isinstance(model, DrawnGPT):
            model.skip_last = config["skip_last"] and step == 1
        if config["varlen"]:
            length = (6, 4, 5)[step % 3]
            inputs, targets = inputs[:, :length], targets[:, :length]
        return inputs, targets

    def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if config["two_forwards"] and inputs.shape[0] > 1:
            half = inputs.shape[0] // 2
            first = lm_loss(model(inputs[:half]), targets[:half]) * half
            second = lm_loss(model(inputs[half:]), targets[half:]) * (inputs.shape[0] - half)
            return (first + second) / inputs.shape[0]
        return lm_loss(model(inputs), targets)

    def reference_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = prepare(model, inputs, targets)
        total = torch.zeros(())
        for x, y in zip(inputs.chunk(micro), targets.chunk(micro)):
            loss = loss_of(model, x, y) / micro
            loss.backward()
            total += loss.detach()
        return total

    def sharded_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = prepare(model, inputs, targets)
        if config["state_dict_round_trip"]:
            sd_options = StateDictOptions(full_state_dict=config["state_dict_round_trip"] == "full")
            cs.set_model_state_dict(model, cs.get_model_state_dict(model, options=sd_options), options=sd_options)
        if config["eval_between"]:
            with torch.no_grad():
                model.eval()
                model(inputs[:1])
                model.train()
        total = torch.zeros(())
        for index, (x, y) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro))):
            last = index == micro - 1
            if config["accumulate_with"] == "set_sync" and micro > 1:
                cs.set_requires_gradient_sync(model, last)
            if config["accumulate_with"] == "no_sync" and not last:
                with cs.no_sync(model):
                    loss = loss_of(model, x, y) / micro
                    loss.backward()
            else:
                loss = loss_of(model, x, y) / micro
                loss.backward()
            total += loss.detach()
        return total

    kept_gathered = config["selection"] in ("per_block", "inner", "pairs") and any(
        value is False for value in config["reshard_after_backward"][: config["n_blocks"]]
    )
    return Parity(
        build=build,
        shard=shard,
        steps=3,
        step_fn=sharded_step,
        reference_step_fn=reference_step,
        make_optimizer=make_optimizer,
        optimizer_before_shard=config["optimizer_before_shard"],
        check_resharded=not kept_gathered,
    )


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations_match_one_process_at_2_ranks(seed: int) -> None:
    run_distributed(_run_configuration, 2, draw(seed, 2))


@pytest.mark.parametrize("seed", range(100, 108))
def test_random_configurations_match_one_process_at_4_ranks(seed: int) -> None:
    run_distributed(_run_configuration, 4, draw(seed, 4))
