"""Owns: handing back to the operating system the heap pages that the C
allocator keeps after frees, while a backward runs on CPU, so that a CPU
rank's resident memory follows its live tensors (and ``plan``'s peak).

Knows nothing of: units, hooks, collectives. The runtime tells it how many
bytes of gathered parameters each unit's backward brings; it decides when
to trim.

[Note: trimming the host heap in backward]
With glibc, after the first step nearly every tensor of a CPU step comes
from the heap (the mmap threshold rises after large frees), and a backward
interleaves long-lived sharded gradients with short-lived per-parameter and
padded gradients: the heap fragments and its free chunks stay resident, so
a rank's RSS ends well above its live tensors (and ``plan``'s peak).
``malloc_trim(0)`` gives whole free pages back without moving anything; it
costs a walk of the arenas and page faults when the pages are used again,
so a unit's pre-backward trims only when the backward gathered
``TRIM_EVERY_BYTES`` since the last trim and the resident set is within
``REACH_PER_GATHERED_BYTE`` times the unit's gathered bytes of its
high-water mark (farther below, this unit cannot make a new peak). Only
bytes really gathered count (a flat parameter that is its own shard, as
NO_SHARD's in its own dtype, brings none). Reading the levels costs a
read of ``/proc/self/status`` (about 30 µs, a sixth of a small unit's
pre-backward), so a check that finds the resident set ``gap``
bytes below the mark also says when the next check is due: a unit's
backward adds at most ``REACH_PER_GATHERED_BYTE`` times its gathered bytes
to the resident set, so no unit reaches the mark before the units after
this one gathered ``gap / REACH_PER_GATHERED_BYTE`` less this unit's
bytes, and their checks are skipped (they would have found the mark out
of reach too). Where a unit's backward can add less than
``SMALL_REACH_FRACTION`` of the mark (many small units: a 200 KB unit
against a 500 MB process), a trim buys at most that share of the peak but
costs page faults on everything it gives back (measured: 64 blocks of
width 64 gave back 42 MB per trim, refaulted by the next step, 2.4% of
the step, and the peak was the same without trims). There the trimmer
trims only once the mark crept that share above its level at the last
trim, and otherwise checks again after the next ``TRIM_EVERY_BYTES``: the
resident set may creep by at most that share between trims. A check that
finds the mark out of a small unit's reach waits as long for the next
(the out-of-reach window alone is a few units there: 64 blocks of width
64 read the levels 21 times a step, 1-3 ms of a 330 ms step).
``COMPOSABLE_SHARD_TRIM_HOST_MEMORY=0`` turns it off; without
``malloc_trim`` (musl, macOS) it does nothing. Measurements: docs/how-it-works.md
("Memory"). Pinned by tests/runtime/test_host_memory.py.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable

__all__ = ["ENV_SWITCH", "HostMemoryTrimmer", "malloc_trim", "resident_and_high_water", "trim_heap", "trimming_enabled"]

ENV_SWITCH = "COMPOSABLE_SHARD_TRIM_HOST_MEMORY"


@functools.lru_cache(maxsize=None)
def malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


def trimming_enabled() -> bool:
    """Whether CPU backwards trim the heap: on unless the switch says ``0``
    and where the C library can."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and malloc_trim() is not None


def trim_heap() -> None:
    """``malloc_trim(0)`` now, where trimming is on (``trimming_enabled``)."""
    trim = malloc_trim()
    if trim is not None and trimming_enabled():
        trim()


def resident_and_high_water() -> tuple[int, int] | None:
    """This process's resident set and its high-water mark in bytes (from
    ``/proc/self/status``), or None where that file is missing."""
    try:
        with open("/proc/self/status", "rb") as status:
            text = status.read()
    except OSError:
        return None
    levels = {}
    for line in text.splitlines():
        if line.startswith((b"VmRSS:", b"VmHWM:")):
            name, value = line.split(b":", 1)
            levels[name] = int(value.split()[0]) * 1024  # kB
    if len(levels) != 2:
        return None
    return levels[b"VmRSS"], levels[b"VmHWM"]


class HostMemoryTrimmer:
    """Counts the bytes a CPU backward gathers; each time
    ``trim_every_bytes`` more went through and the resident set is within
    reach of its high-water mark, trims the heap (see [Note: trimming the
    host heap in backward])."""

    # A trim at most once per this many gathered bytes in backward.
    TRIM_EVERY_BYTES = 64 * 2**20
    # Below the high-water mark by more than this many times a unit's
    # gathered bytes, the unit's backward (its gathered parameters, the
    # per-parameter and padded gradients, its reduction's output) cannot
    # make a new peak before the next unit's check: no trim.
    REACH_PER_GATHERED_BYTE = 4
    # A unit that can add less than this share of the high-water mark trims
    # only once the mark grew this share since the last trim.
    SMALL_REACH_FRACTION = 1 / 64

    def __init__(
        self,
        trim_every_bytes: int | None = None,
        read_levels: Callable[[], tuple[int, int] | None] = resident_and_high_water,
    ) -> None:
        self.trim_every_bytes = self.TRIM_EVERY_BYTES if trim_every_bytes is None else trim_every_bytes
        self._read_levels = read_levels
        self._bytes_since_trim = 0
        # Bytes gathered since the last check, and how many more the last
        # check said cannot reach the high-water mark.
        self._bytes_since_check = 0
        self._out_of_reach_bytes = 0
        # The high-water mark when the last trim ran (0: none ran yet).
        self._high_water_at_trim = 0
        self.trims = 0  # how many trims ran (tests and the bench read it)
        self.checks = 0  # how many times the levels were read

    def unit_backward_starts(self, gathered_bytes: int) -> None:
        """A unit's backward starts; it gathered ``gathered_bytes`` (0 where
        its flat parameters are their own shards)."""
        self._bytes_since_trim += gathered_bytes
        self._bytes_since_check += gathered_bytes
        if self._bytes_since_trim < self.trim_every_bytes or self._bytes_since_check < self._out_of_reach_bytes:
            return
        self._bytes_since_check, self._out_of_reach_bytes = 0, 0
        levels = self._read_levels()
        self.checks += 1
        if levels is not None:
            resident, high_water = levels
            reach = self.REACH_PER_GATHERED_BYTE
            small = reach * gathered_bytes < high_water * self.SMALL_REACH_FRACTION
            if small and high_water < self._high_water_at_trim * (1 + self.SMALL_REACH_FRACTION):
                # A small unit, and the mark has not crept since the last
                # trim: a trim would cost more faults than the peak it saves.
                self._bytes_since_trim = 0
                return
            if resident + reach * gathered_bytes < high_water:
                # Far from the peak: a trim now would only cost page faults,
                # and so would one until that many more bytes were gathered;
                # a small unit's next check waits a whole trim_every_bytes.
                self._out_of_reach_bytes = (high_water - resident) // reach - gathered_bytes
                if small:
                    self._bytes_since_trim = 0
                return
            self._high_water_at_trim = high_water
        trim = malloc_trim()
        if trim is not None:
            trim()
            self.trims += 1
        self._bytes_since_trim = 0
