"""Trimming the host heap in CPU backwards ([Note: trimming the host heap in
backward] in runtime/host_memory.py): glibc's ``malloc_trim`` really gives free heap
pages back, the trimmer runs it once per ``trim_every_bytes`` gathered, a
CPU training step trims at unit boundaries without changing any result, and
the switch turns it off."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform

import torch.nn as nn

import composable_shard as cs
from composable_shard.runtime import host_memory
from composable_shard.runtime.state import get_state

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, run_parity

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def test_malloc_trim_is_found_exactly_where_the_c_library_is_glibc() -> None:
    assert (host_memory.malloc_trim() is not None) == (platform.libc_ver()[0] == "glibc")


def test_malloc_trim_gives_freed_heap_pages_back_to_the_os() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    # 64 KiB chunks stay below glibc's smallest mmap threshold (128 KiB): they
    # come from the heap. The chunk allocated last pins the heap's top, so
    # freeing the others leaves 32 MiB of free, resident pages in the middle,
    # which only malloc_trim gives back.
    chunk, count = 64 * 1024, 512
    chunks = [libc.malloc(chunk) for _ in range(count)]
    pin = libc.malloc(chunk)
    try:
        for address in chunks:
            libc.memset(address, 1, chunk)
        for address in chunks:
            libc.free(address)
        before = _rss_bytes()
        trim = host_memory.malloc_trim()
        assert trim is not None
        trim()
        released = before - _rss_bytes()
    finally:
        libc.free(pin)
    assert released >= count * chunk // 2, f"malloc_trim gave back {released} bytes of {count * chunk} freed"


def test_resident_and_high_water_are_this_process_levels() -> None:
    levels = host_memory.resident_and_high_water()
    assert levels is not None
    resident, high_water = levels
    assert 0 < resident <= high_water
    with mmap.mmap(-1, 32 * 2**20) as fresh:  # new pages, resident once written
        fresh.write(b"x" * len(fresh))
        grown = host_memory.resident_and_high_water()
    assert grown is not None and grown[0] >= resident + 30 * 2**20 and grown[1] >= grown[0], (levels, grown)


def test_trimmer_trims_once_per_trim_every_bytes_gathered_near_the_high_water_mark() -> None:
    # Resident set and high-water mark the trimmer reads at each check.
    levels = iter([(1000, 1000), (500, 1000), (900, 1000), (500, 1000), None])
    trimmer = host_memory.HostMemoryTrimmer(trim_every_bytes=100, read_levels=lambda: next(levels))
    counts = []
    for gathered in (60, 30, 10, 99, 250, 0, 100, 30, 100):
        trimmer.unit_backward_starts(gathered)
        counts.append(trimmer.trims)
    # 60, 90: under trim_every_bytes, no check. 100: at the mark, trim.
    # 99, then 349 with (500, 1000): 500 + 4 * 250 >= 1000, trim. 0, then 100
    # with (900, 1000): trim. 30, then 130 with (500, 1000): 500 + 4 * 100 <
    # 1000, too far below the mark, no trim.
    assert counts == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    # That check also said no unit reaches the mark before 500 / 4 - 100 = 25
    # more bytes: 24 are not checked, the 25th is; no levels there: trim.
    trimmer.unit_backward_starts(24)
    assert (trimmer.checks, trimmer.trims) == (4, 3)
    trimmer.unit_backward_starts(1)
    assert (trimmer.checks, trimmer.trims) == (5, 4)


def test_a_check_far_below_the_mark_skips_the_checks_that_could_not_reach_it() -> None:
    reads: list[tuple[int, int] | None] = []
    levels = iter([(100, 1000), (700, 1000), (100, 1000), None])

    def read_levels() -> tuple[int, int] | None:
        reads.append(next(levels))
        return reads[-1]

    trimmer = host_memory.HostMemoryTrimmer(trim_every_bytes=100, read_levels=read_levels)
    # 100 with (100, 1000): 100 + 4 * 100 < 1000, no trim. A unit's backward
    # adds at most 4 times its bytes, so the mark is out of reach until the
    # next units gathered 900 / 4 - 100 = 125 bytes: no check before.
    trimmer.unit_backward_starts(100)
    assert (len(reads), trimmer.trims) == (1, 0)
    trimmer.unit_backward_starts(99)
    trimmer.unit_backward_starts(1)
    assert (len(reads), trimmer.trims) == (1, 0)
    # 125 with (700, 1000): 700 + 4 * 25 < 1000, no trim; next check after
    # 300 / 4 - 25 = 50 bytes.
    trimmer.unit_backward_starts(25)
    assert (len(reads), trimmer.trims) == (2, 0)
    trimmer.unit_backward_starts(49)
    assert (len(reads), trimmer.trims) == (2, 0)
    trimmer.unit_backward_starts(1)  # 50 with (100, 1000): far again, 900 / 4 - 1 = 224 to go
    assert (len(reads), trimmer.trims) == (3, 0)
    trimmer.unit_backward_starts(223)
    assert (len(reads), trimmer.trims) == (3, 0)
    trimmer.unit_backward_starts(1)  # 224, no levels: trim
    assert (len(reads), trimmer.trims) == (4, 1)


def test_small_units_trim_again_only_once_the_mark_crept_a_sixty_fourth() -> None:
    mark = 64_000  # a unit of 10 bytes reaches 40 < 64_000 / 64 = 1_000: small
    levels = iter([(mark, mark), (mark + 999, mark + 999), (mark + 1_000, mark + 1_000), (mark + 1_000, mark + 1_000)])
    trimmer = host_memory.HostMemoryTrimmer(trim_every_bytes=100, read_levels=lambda: next(levels))
    for _ in range(10):
        trimmer.unit_backward_starts(10)
    assert (trimmer.checks, trimmer.trims) == (1, 1)  # the first trim: none ran before
    for _ in range(10):
        trimmer.unit_backward_starts(10)
    # At the mark, but the mark grew less than 1/64 since the trim: no trim,
    # and no check before another trim_every_bytes.
    assert (trimmer.checks, trimmer.trims) == (2, 1)
    for _ in range(9):
        trimmer.unit_backward_starts(10)
    assert (trimmer.checks, trimmer.trims) == (2, 1)
    trimmer.unit_backward_starts(10)  # the mark grew 1/64: trim
    assert (trimmer.checks, trimmer.trims) == (3, 2)
    # A unit that can add 1/64 of the mark (4 * 300 > 65_000 / 64) is not
    # small: within reach of the mark it trims, however little the mark grew.
    trimmer.unit_backward_starts(300)
    assert (trimmer.checks, trimmer.trims) == (4, 3)


def test_small_units_far_below_the_mark_check_once_per_trim_every_bytes() -> None:
    mark = 64_000  # a unit of 10 bytes reaches 40 < 64_000 / 64 = 1_000: small
    reads: list[tuple[int, int]] = []

    def read_levels() -> tuple[int, int]:
        reads.append((mark - 200, mark))  # 200 below: out of reach for 200 / 4 - 10 = 40 bytes
        return reads[-1]

    trimmer = host_memory.HostMemoryTrimmer(trim_every_bytes=100, read_levels=read_levels)
    for _ in range(10):
        trimmer.unit_backward_starts(10)
    assert (len(reads), trimmer.trims) == (1, 0)
    # The out-of-reach window (40 bytes) alone would check again after 5
    # units; a small unit waits another trim_every_bytes.
    for _ in range(9):
        trimmer.unit_backward_starts(10)
    assert (len(reads), trimmer.trims) == (1, 0)
    trimmer.unit_backward_starts(10)
    assert (len(reads), trimmer.trims) == (2, 0)


def _trimming_keeps_training_exact(rank: int, world_size: int) -> None:
    models: list[nn.Module] = []

    def shard(model: nn.Module, strategy: cs.ShardingStrategy = cs.ShardingStrategy.FULL_SHARD) -> None:
        for block in model.blocks:  # type: ignore[union-attr]
            cs.fully_shard(block, strategy=strategy)
        cs.fully_shard(model, strategy=strategy)
        models.append(model)

    steps = 3
    trimmer_class = host_memory.HostMemoryTrimmer
    default_every, default_reach = trimmer_class.TRIM_EVERY_BYTES, trimmer_class.REACH_PER_GATHERED_BYTE
    # Every unit's backward trims, however far below its high-water mark.
    trimmer_class.TRIM_EVERY_BYTES = 1
    trimmer_class.REACH_PER_GATHERED_BYTE = 2**40
    try:
        run_parity(Parity(build=TinyGPT, shard=shard, steps=steps))
    finally:  # the worker process serves later tests
        trimmer_class.TRIM_EVERY_BYTES = default_every
        trimmer_class.REACH_PER_GATHERED_BYTE = default_reach
    trimmer = get_state(models[0]).root_context.host_memory_trimmer
    assert trimmer is not None
    units = 1 + len(models[0].blocks)  # type: ignore[union-attr, arg-type]
    assert trimmer.trims == steps * units, (trimmer.trims, steps, units)

    # NO_SHARD in the parameters' dtype gathers nothing: no byte counts, no
    # trim, however small TRIM_EVERY_BYTES.
    models.clear()
    trimmer_class.TRIM_EVERY_BYTES = 1
    trimmer_class.REACH_PER_GATHERED_BYTE = 2**40
    try:
        run_parity(Parity(build=TinyGPT, shard=functools.partial(shard, strategy=cs.ShardingStrategy.NO_SHARD), steps=2))
    finally:
        trimmer_class.TRIM_EVERY_BYTES = default_every
        trimmer_class.REACH_PER_GATHERED_BYTE = default_reach
    trimmer = get_state(models[0]).root_context.host_memory_trimmer
    assert trimmer is not None and trimmer.trims == 0, trimmer.trims

    os.environ[host_memory.ENV_SWITCH] = "0"
    try:
        models.clear()
        run_parity(Parity(build=TinyGPT, shard=shard, steps=1))
        assert get_state(models[0]).root_context.host_memory_trimmer is None
    finally:
        os.environ.pop(host_memory.ENV_SWITCH)


def test_cpu_backward_trims_at_unit_boundaries_and_training_stays_exact() -> None:
    run_distributed(_trimming_keeps_training_exact, 2)
