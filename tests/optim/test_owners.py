"""Owner choice ([Note: choosing owners] in composable_shard/optim/owners.py):
deterministic, balanced within the bound the issue sets, and keeping a
parameter on the rank that holds it whole where balance allows."""

from __future__ import annotations

import random

from composable_shard.optim.owners import param_cost, plan_owners


def _pieces(sizes: list[int], world_size: int) -> list[tuple[tuple[int, int], ...]]:
    """Each parameter's range on each rank of a flat layout of ``sizes``."""
    total = sum(sizes)
    shard = -(-total // world_size)
    pieces, offset = [], 0
    for size in sizes:
        ranges = []
        for rank in range(world_size):
            start = max(offset, rank * shard) - offset
            stop = min(offset + size, (rank + 1) * shard) - offset
            ranges.append((start, stop) if stop > start else (0, 0))
        pieces.append(tuple(ranges))
        offset += size
    return pieces


def test_costs_count_matrix_functions() -> None:
    assert param_cost((768, 256)) == 768 * 256 * 256
    assert param_cost((256,)) == 256
    assert param_cost((4, 3, 2)) == 24 * 4  # rows 4, columns 6


def test_owners_are_balanced_and_deterministic() -> None:
    generator = random.Random(0)
    for _ in range(200):
        world_size = generator.choice([2, 3, 4, 8])
        shapes = [(generator.randint(1, 64), generator.randint(1, 64)) for _ in range(generator.randint(1, 30))]
        sizes = [rows * cols for rows, cols in shapes]
        costs = [param_cost(shape) for shape in shapes]
        pieces = _pieces(sizes, world_size)
        owners = plan_owners(costs, pieces, world_size)
        assert owners == plan_owners(costs, pieces, world_size)
        work = [0.0] * world_size
        for owner, cost in zip(owners, costs):
            work[owner] += cost
        assert max(work) <= 2 * sum(costs) / world_size + max(costs), (shapes, world_size, work)


def test_a_parameter_held_whole_stays_where_balance_allows() -> None:
    # Two alike blocks of [attention 16x48, mlp 48x16] over 2 ranks: each rank
    # holds one block whole; the holder keeps all of its parameters.
    sizes = [16 * 48, 48 * 16, 16 * 48, 48 * 16]
    costs = [param_cost((16, 48)), param_cost((48, 16))] * 2
    assert plan_owners(costs, _pieces(sizes, 2), 2) == [0, 0, 1, 1]
    # Every attention matrix in rank 0's half and every MLP one in rank 1's,
    # the MLP three times the cost: some MLP matrices move to rank 0.
    costs = [1.0, 3.0, 1.0, 3.0]
    pieces = [((0, 1), (0, 0)), ((0, 0), (0, 1)), ((0, 1), (0, 0)), ((0, 0), (0, 1))]
    owners = plan_owners(costs, pieces, 2)
    work = [sum(c for c, o in zip(costs, owners) if o == rank) for rank in range(2)]
    assert max(work) <= sum(costs) / 2 + max(costs) and 0 in owners[1::2], owners
