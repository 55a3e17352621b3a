"""``largest_fitting``: the largest model size whose plan fits a memory
budget per rank is the one a size-by-size scan of ``plan`` finds, for any
budget, with few plans; bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch

import composable_shard as cs

from tests.support.models import Block, TinyGPT


def _meta_gpt(n_layers: int) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(n_blocks=n_layers)


def _total(n_layers: int) -> int:
    return cs.plan(_meta_gpt(n_layers), world_size=2, policy={Block}, device="cpu").rank_bytes["total"]


def test_largest_fitting_is_the_largest_size_whose_plan_fits() -> None:
    totals = {n: _total(n) for n in range(1, 41)}
    assert all(totals[n] < totals[n + 1] for n in range(1, 40)), "the plan's peak grows with the size"
    for n in (1, 2, 7, 16, 33):  # budgets exactly at a size's peak, and just below the next
        for budget in (totals[n], totals[n + 1] - 1):
            found = cs.largest_fitting(_meta_gpt, budget, world_size=2, policy={Block}, device="cpu", high=40)
            assert found.n == n, (budget, found.n)
            assert found.plan is not None and found.plan.rank_bytes["total"] == totals[n]
            assert found.next_total == totals[n + 1]
            assert found.bytes_per_step == totals[n + 1] - totals[n]
            assert len(found.planned) <= 2 * n.bit_length() + 3, f"{len(found.planned)} plans for n={n}"


def test_largest_fitting_answers_zero_when_nothing_fits_and_high_when_all_do() -> None:
    nothing = cs.largest_fitting(_meta_gpt, _total(1) - 1, world_size=2, policy={Block}, device="cpu")
    assert (nothing.n, nothing.plan) == (0, None)
    everything = cs.largest_fitting(_meta_gpt, 2**50, world_size=2, policy={Block}, device="cpu", high=12)
    assert everything.n == 12 and everything.next_total is None and everything.bytes_per_step is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(budget_bytes=-1), "budget_bytes must be a non-negative int"),
        (dict(budget_bytes=1.5), "budget_bytes must be a non-negative int"),
        (dict(budget_bytes=10, low=0), "1 <= low <= high"),
        (dict(budget_bytes=10, low=5, high=4), "1 <= low <= high"),
    ],
)
def test_largest_fitting_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cs.largest_fitting(_meta_gpt, world_size=2, **kwargs)
