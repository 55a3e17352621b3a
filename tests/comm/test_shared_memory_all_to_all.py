"""The shared-memory all-to-all (``HostSharedMemory.all_to_all``, [Note:
shared-memory all-to-all] in comm/shared_memory/collectives.py), which
``comm.all_to_all`` takes for CPU tensors of a group on one host: gloo's
``all_to_all_single`` bit for bit whatever the splits (uneven, zero, all
zero), dtype and rounds (pieces many times a slot), and from and into
lists of tensors in place (``comm.all_to_all_pieces``); within the slots the
group's other collectives reserved; splits that do not pair refused alike
on every rank, the group going on; beside another collective, an error
naming both. (A peer killed before it: tests/comm/test_failures.py.)"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import process_group, shared_memory, transport

from tests.support.comm_spies import gloo_only_group, shared_memory_slot_bytes
from tests.support.harness_pool import run_distributed


@contextlib.contextmanager
def _gloo_refused() -> Iterator[None]:
    """Fail the test if ``comm.all_to_all`` takes the gloo path inside."""
    real = process_group.all_to_all

    def refuse(*args: Any) -> None:
        raise AssertionError("comm.all_to_all went through gloo, not shared memory")

    process_group.all_to_all = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        process_group.all_to_all = real


def _split_matrices(world_size: int, most: int) -> list[list[list[int]]]:
    """Every rank's sends to every rank (``[writer][reader]`` elements),
    known to every rank: random uneven ones with zeros, all zero, only to
    oneself, everything to one rank, one rank sending nothing."""
    generator = torch.Generator().manual_seed(7 * world_size + most)
    uneven = torch.randint(0, most + 1, (world_size, world_size), generator=generator)
    uneven[uneven < most // 4] = 0
    only_own = torch.diag(torch.full((world_size,), most))
    to_one = torch.zeros(world_size, world_size, dtype=torch.int64)
    to_one[:, world_size - 1] = most
    silent = torch.randint(1, most + 1, (world_size, world_size), generator=generator)
    silent[0] = 0
    zero = torch.zeros(world_size, world_size, dtype=torch.int64)
    return [matrix.tolist() for matrix in (uneven, zero, only_own, to_one, silent)]


def _inputs(world_size: int, sends: list[list[int]], dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    """Every rank's input, known to every rank."""
    generator = torch.Generator().manual_seed(salt)
    if dtype is torch.int64:
        return [torch.randint(-(2**62), 2**62, (sum(row),), generator=generator) for row in sends]
    return [torch.randn(sum(row), generator=generator).to(dtype) for row in sends]


def _exchange(rank: int, world_size: int, sends: list[list[int]], inputs: list[torch.Tensor], group: Any) -> torch.Tensor:
    """``comm.all_to_all`` of ``inputs[rank]`` over ``group``."""
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    output = torch.full((sum(output_splits),), 3, dtype=inputs[rank].dtype)
    comm.all_to_all(output, inputs[rank].clone(), output_splits, sends[rank], group)
    return output


def _all_to_all_equals_gloo(rank: int, world_size: int) -> None:
    """One round per piece (default slots), many rounds (slots of 1000
    bytes: not a multiple of any element), and a group on gloo, against
    gloo's all_to_all_single on the default group."""
    whole = dist.new_group(list(range(world_size)))
    with shared_memory_slot_bytes(1000):
        small = dist.new_group(list(range(world_size)))
        assert transport.shared_memory_of(small) is not None
    assert transport.shared_memory_of(whole) is not None
    gloo = gloo_only_group(world_size)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for most in (1, 7, 3001):
            for index, sends in enumerate(_split_matrices(world_size, most)):
                inputs = _inputs(world_size, sends, dtype, salt=100 * most + index)
                output_splits = [sends[writer][rank] for writer in range(world_size)]
                expected = torch.empty(sum(output_splits), dtype=dtype)
                dist.all_to_all_single(expected, inputs[rank].clone(), output_splits, sends[rank])
                # What each rank sent this rank, in rank order.
                starts = [sum(sends[writer][:rank]) for writer in range(world_size)]
                pieces = [inputs[writer][starts[writer] : starts[writer] + sends[writer][rank]] for writer in range(world_size)]
                assert torch.equal(expected, torch.cat(pieces))
                with _gloo_refused():
                    for group in (whole, small):
                        got = _exchange(rank, world_size, sends, inputs, group)
                        assert torch.equal(got, expected), (dtype, most, index, group is small)
                assert torch.equal(_exchange(rank, world_size, sends, inputs, gloo), expected)
    # A strided output and input are exchanged through contiguous copies.
    sends = _split_matrices(world_size, 9)[0]
    inputs = _inputs(world_size, sends, torch.float32, salt=5)
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    strided_output = torch.zeros(2 * sum(output_splits))[::2]
    strided_input = torch.zeros(2 * sum(sends[rank]))
    strided_input[::2] = inputs[rank]
    with _gloo_refused():
        comm.all_to_all(strided_output, strided_input[::2], output_splits, sends[rank], small)
    assert torch.equal(strided_output, _exchange(rank, world_size, sends, inputs, gloo))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_through_shared_memory_equals_gloo(world_size: int) -> None:
    run_distributed(_all_to_all_equals_gloo, world_size)


def _cut(total: int, generator: torch.Generator) -> list[int]:
    """``total`` elements as random piece sizes, empty pieces among them."""
    sizes = []
    while total > 0:
        size = min(total, int(torch.randint(0, 40, (1,), generator=generator)))
        sizes.append(size)
        total -= size
    return [0, *sizes, 0]


def _pieces_equal_gloo(rank: int, world_size: int) -> None:
    """``comm.all_to_all_pieces``: inputs and outputs in separate tensors of
    random sizes (empty ones too), pieces crossing the rounds of small slots
    and the ranks' splits, equal gloo's all_to_all_single of the same bytes;
    only where ``all_to_all_in_place`` says so, a clear error elsewhere."""
    whole = dist.new_group(list(range(world_size)))
    with shared_memory_slot_bytes(1000):
        small = dist.new_group(list(range(world_size)))
    gloo = gloo_only_group(world_size)
    cpu = torch.device("cpu")
    assert comm.all_to_all_in_place(cpu, whole) and comm.all_to_all_in_place(cpu, small)
    assert not comm.all_to_all_in_place(cpu, gloo) and not comm.all_to_all_in_place(torch.device("meta"), whole)
    generator = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for most in (7, 3001):
            for index, sends in enumerate(_split_matrices(world_size, most)):
                inputs = _inputs(world_size, sends, dtype, salt=100 * most + index)
                output_splits = [sends[writer][rank] for writer in range(world_size)]
                expected = torch.empty(sum(output_splits), dtype=dtype)
                dist.all_to_all_single(expected, inputs[rank].clone(), output_splits, sends[rank])
                sent = list(inputs[rank].clone().split(_cut(inputs[rank].numel(), generator)))
                for group in (whole, small):
                    outputs = [torch.full((size,), 3, dtype=dtype) for size in _cut(expected.numel(), generator)]
                    with _gloo_refused():
                        comm.all_to_all_pieces(outputs, sent, output_splits, sends[rank], group)
                    assert torch.equal(torch.cat(outputs), expected), (dtype, most, index, group is small)
    sends = _split_matrices(world_size, 5)[0]
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    # A strided piece is refused before anything is issued: the group goes on.
    strided = torch.zeros(2 * sum(sends[rank]))[::2]
    with pytest.raises(ValueError, match=r"shared-memory collectives need contiguous tensors"):
        comm.all_to_all_pieces([torch.empty(sum(output_splits))], [strided], output_splits, sends[rank], whole)
    # The same group's next all-to-all is right: rank w sends element i as 1000 w + i.
    outputs = [torch.empty(sum(output_splits))]
    sent = [torch.arange(sum(sends[rank]), dtype=torch.float32) + 1000 * rank]
    comm.all_to_all_pieces(outputs, sent, output_splits, sends[rank], whole)
    starts = [sum(sends[writer][:rank]) for writer in range(world_size)]
    expected = torch.cat([
        torch.arange(starts[writer], starts[writer] + sends[writer][rank], dtype=torch.float32) + 1000 * writer
        for writer in range(world_size)
    ])
    assert torch.equal(outputs[0], expected)
    with pytest.raises(RuntimeError, match=r"all_to_all_pieces: this group's collectives do not go through shared "
                                           r"memory; check all_to_all_in_place first"):
        comm.all_to_all_pieces([torch.empty(sum(output_splits))], [torch.empty(sum(sends[rank]))], output_splits,
                               sends[rank], gloo)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_of_pieces_in_place_equals_gloo(world_size: int) -> None:
    run_distributed(_pieces_equal_gloo, world_size)


def _all_to_all_within_reserved_slots(rank: int, world_size: int) -> None:
    """A group whose collectives reserved 64 KiB per slot: an all-to-all of
    far more streams through those 64 KiB (its files do not grow) and still
    equals gloo."""
    group = dist.new_group(list(range(world_size)))
    shared = transport.shared_memory_of(group, 1000)
    assert shared is not None
    reserved = shared.shared_bytes
    assert reserved == shared_memory.bytes_per_rank(1000, shared_memory.SLOT_BYTES)
    most = 100_000  # 400 KB per piece: rounds of 64 KiB
    sends = [[most + writer * 1000 + reader for reader in range(world_size)] for writer in range(world_size)]
    inputs = _inputs(world_size, sends, torch.float32, salt=11)
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    expected = torch.empty(sum(output_splits))
    dist.all_to_all_single(expected, inputs[rank].clone(), output_splits, sends[rank])
    with _gloo_refused():
        got = _exchange(rank, world_size, sends, inputs, group)
    assert torch.equal(got, expected)
    assert shared.shared_bytes == reserved


@pytest.mark.parametrize("world_size", [2])
def test_all_to_all_streams_within_the_slots_other_collectives_reserved(world_size: int) -> None:
    run_distributed(_all_to_all_within_reserved_slots, world_size)


def _unpaired_splits_refused_alike(rank: int, world_size: int) -> None:
    """Splits that do not pair (a rank expecting more than its peer sends),
    or tensors of different dtypes, raise the same ValueError on every rank
    once the splits were exchanged; nothing was sent, so the same group's
    next all-to-all is right. Splits that do not fit the rank's own tensors
    are refused before anything is issued."""
    group = dist.new_group(list(range(world_size)))
    assert transport.shared_memory_of(group) is not None
    sends = [[2 + writer + reader for reader in range(world_size)] for writer in range(world_size)]
    inputs = _inputs(world_size, sends, torch.float32, salt=3)
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    if rank == 0:
        output_splits[1] += 1
    with pytest.raises(ValueError, match=r"rank 1 sends 3 elements to rank 0, whose output_splits\[1\] is 4\. .*go on"):
        comm.all_to_all(torch.empty(sum(output_splits)), inputs[rank].clone(), output_splits, sends[rank], group)
    dtype = torch.float64 if rank == world_size - 1 else torch.float32
    output_splits = [sends[writer][rank] for writer in range(world_size)]
    with pytest.raises(ValueError, match=r"elements of \[4, .*8\] bytes \(by rank\); every rank must pass the same dtype"):
        comm.all_to_all(torch.empty(sum(output_splits), dtype=dtype), inputs[rank].to(dtype), output_splits, sends[rank], group)
    with pytest.raises(ValueError, match=r"input_splits \[1\] must be \d counts \(one per rank\)"):
        comm.all_to_all(torch.empty(1), torch.zeros(1), [1] + [0] * (world_size - 1), [1], group)
    with pytest.raises(ValueError, match=r"output_splits .* summing to the output's 5 elements"):
        comm.all_to_all(torch.empty(5), torch.zeros(1), [1] + [0] * (world_size - 1), [1] + [0] * (world_size - 1), group)
    expected = _exchange(rank, world_size, sends, inputs, gloo_only_group(world_size))
    with _gloo_refused():
        assert torch.equal(_exchange(rank, world_size, sends, inputs, group), expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_splits_that_do_not_pair_are_refused_on_every_rank_and_the_group_goes_on(world_size: int) -> None:
    run_distributed(_unpaired_splits_refused_alike, world_size)


def _beside_another_collective(rank: int, world_size: int) -> None:
    """Rank 0 issues an all-to-all where rank 1 issues an all-gather writing
    as many bytes as the all-to-all's first round: each gets an error naming
    both (the kinds differ), never the other's bytes."""
    group = dist.new_group(list(range(world_size)))  # its own transport: this one is left broken
    assert transport.shared_memory_of(group) is not None
    table_bytes = (2 + 2 * world_size) * 8
    if rank == 0:
        with pytest.raises(RuntimeError, match=rf"rank 1 of the group issued an all-gather writing {table_bytes} bytes "
                           rf"where this rank \(rank 0\) issued an all-to-all writing {table_bytes} bytes"):
            comm.all_to_all(torch.empty(world_size), torch.zeros(world_size), [1] * world_size, [1] * world_size, group)
        with pytest.raises(RuntimeError, match=r"an all-to-all failed after part of it was sent .*cannot go on"):
            comm.all_reduce(torch.zeros(1), group, async_op=False)
    else:
        shard = torch.zeros(table_bytes // 4)
        with pytest.raises(RuntimeError, match=rf"rank 0 of the group issued an all-to-all writing {table_bytes} bytes"):
            comm.all_gather_into(torch.empty(shard.numel() * world_size), shard, group, async_op=False)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_all_to_all_beside_another_collective_gets_an_error_not_wrong_data(world_size: int) -> None:
    run_distributed(_beside_another_collective, world_size)

