"""A trainable parameter that a backward leaves without a gradient while the
rest of its unit gets one: the runtime warns, once, naming it ([Note:
parameters a backward leaves without a gradient] in
composable_shard/handle/grad_usage.py); nothing is said when every
parameter is reached, when the module is a unit of its own, or when another
micro-batch of the same reduction reaches it."""

from __future__ import annotations

import warnings

import torch

from composable_shard import fully_shard, no_sync

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss


class SkippingGPT(TinyGPT):
    """TinyGPT whose last block is left out of the forwards ``skip`` says."""

    def __init__(self) -> None:
        super().__init__(n_blocks=3)
        self.skip = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks if not self.skip else self.blocks[:-1]:
            x = block(x)
        return self.head(self.norm(x))


def _train(model: SkippingGPT, skips: list[list[bool]]) -> list[str]:
    """One backward per micro-batch, ``no_sync`` for all but the last of each
    step; returns the warnings' texts."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, micro in enumerate(skips):
            inputs, targets = batch(step)
            for index, skip in enumerate(micro):
                model.skip = skip
                if index < len(micro) - 1:
                    with no_sync(model):
                        lm_loss(model(inputs), targets).backward()
                else:
                    lm_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [str(w.message) for w in caught if "since its last gradient reduction reached" in str(w.message)]


def _warns_once_naming_the_unreached_parameters(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = SkippingGPT()
    fully_shard(model)  # one unit: the skipped block shares the root's flat gradient
    texts = _train(model, [[False], [True], [True]])
    assert len(texts) == 1, texts
    # Block 2's six parameters: five named, then how many more.
    for name in ("blocks.2.norm.weight", "blocks.2.fc_in.weight", "blocks.2.fc_out.weight", "and 1 more"):
        assert name in texts[0], texts[0]
    assert "blocks.1." not in texts[0] and "tok_emb" not in texts[0], texts[0]
    assert "unit '<root>'" in texts[0], texts[0]


def test_a_parameter_no_backward_reaches_in_a_unit_that_ran_is_named_once() -> None:
    run_distributed(_warns_once_naming_the_unreached_parameters, 2)


def _silent_when_reached_or_a_unit_of_its_own(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = SkippingGPT()
    fully_shard(model)
    assert _train(model, [[False], [False]]) == []
    # The skipped block a unit of its own: it reduces nothing and keeps None.
    model = SkippingGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert _train(model, [[False], [True]]) == []
    assert all(p.grad is None for p in model.blocks[2].parameters())
    # Reached by another micro-batch of the same reduction (no_sync).
    model = SkippingGPT()
    fully_shard(model)
    assert _train(model, [[True, False], [False, True]]) == []
    # Frozen parameters are never named.
    model = SkippingGPT()
    model.blocks[2].requires_grad_(False)
    fully_shard(model)
    assert _train(model, [[True], [False]]) == []


def test_no_warning_when_every_parameter_is_reached_or_its_unit_did_not_run() -> None:
    run_distributed(_silent_when_reached_or_a_unit_of_its_own, 2)


def _watched_first_then_one_in_every(rank: int, world_size: int) -> None:
    from composable_shard.handle.grad_usage import GradUsage

    saved = GradUsage.WATCH_FIRST, GradUsage.WATCH_EVERY
    GradUsage.WATCH_FIRST, GradUsage.WATCH_EVERY = 2, 3
    try:
        torch.manual_seed(0)
        model = SkippingGPT()
        fully_shard(model)
        # Reductions 1 and 2 watched; 3 not (the block skipped there goes
        # unnoticed); 4 watched again (after 3 reductions, a multiple of 3).
        texts = _train(model, [[False], [False], [True], [True]])
        assert len(texts) == 1, texts
        torch.manual_seed(0)
        model = SkippingGPT()
        fully_shard(model)
        assert _train(model, [[False], [False], [True], [False]]) == []
    finally:
        GradUsage.WATCH_FIRST, GradUsage.WATCH_EVERY = saved


def test_reductions_are_watched_first_then_one_in_every() -> None:
    run_distributed(_watched_first_then_one_in_every, 2)
