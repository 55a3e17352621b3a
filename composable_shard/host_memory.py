"""Owns: handing back to the operating system the heap pages that the C
allocator keeps after frees, while a backward runs on CPU, so that a CPU
rank's resident memory follows its live tensors (and ``plan``'s peak).

Knows nothing of: units, hooks, collectives. The runtime tells it how many
bytes of gathered parameters each unit's backward brings; it decides when
to trim.

[Note: trimming the host heap in backward]
On Linux with glibc, large tensors are ``malloc``ed: above the mmap
threshold from fresh mappings that ``free`` unmaps, below it from the heap,
whose freed chunks stay resident. glibc moves the threshold up to the size
of each mapping freed (to at most 32 MiB), and a heap chunk that fits any
request serves it first, so after the first step nearly every tensor of a
CPU training step comes from the heap. A backward mixes allocations that
live until the optimizer step (each unit's sharded gradient) with ones freed
within the unit (per-parameter gradients, the padded flat gradient, the
collectives' copies): the long-lived ones land in holes the short-lived
left, the next unit's short-lived ones no longer fit the rest, the heap
grows, and its free chunks stay resident. Measured with ``mallinfo2`` at
each unit boundary (GPT of 24 blocks of width 1,280, 2 ranks, step 2): the
heap grew from 2,139 to 2,803 MB over one backward while its free bytes
grew from 29 to 345 MB; the rank's RSS peak was 11-13% above its live
tensors (``plan``'s peak), and FSDP1 loses as much under the same allocator
(60 blocks fit this machine with glibc's defaults, 66 with a fixed 128 KiB
mmap threshold).

``malloc_trim(0)`` gives back every whole free page of every arena
(``madvise``; chunks stay where they are, so nothing moves). It costs a
walk of the arenas (3-7 ms per call at 24 blocks) and page faults when the
pages are used again (a GiB touched afresh costs about 0.16 s more than a
resident one on this machine). So it runs at a unit's pre-backward only
when both hold:

- the backward has gathered ``trim_every_bytes`` since the last trim
  (64 MiB: every unit of a GPT of width 1,280, every few steps for a small
  model, whose churn is too small to matter);
- the resident set is within ``REACH_PER_GATHERED_BYTE`` (4) times the
  unit's gathered bytes of the process's high-water mark (``VmHWM``).
  Farther below it, this unit's backward cannot make a new peak before the
  next unit's check, and a trim would only cost page faults. In the first
  step the resident set is its high-water mark, so every unit trims; later
  steps trim near the end of backward, where the peak is.

Without the second condition, trims cost 23% of the step at 326M (16 x
1,280, sequence 256) in ``scripts/bench.py``'s timing pass, whose malloc
thresholds fixed at 256 MiB keep every buffer in the heap, so every trim
gave back what the next unit faulted in again (7,613 and 7,498 ms against
6,150 ms with trims off; FSDP1 10.2-10.5 s). With it, one interleaved run
each: 6,829 ms (FSDP1 11,243) against 6,328 (FSDP1 10,924) off, 0.61x
against 0.58x FSDP1's step; with glibc's defaults (``--no-fixed-malloc``)
8,387 ms (0.75x FSDP1's) against 8,738 (0.76x) off, no cost to see.
Trimming at every all-gather and every free gave the same peak at twice the
calls; at the forward's end and before the optimizer step it did not help
(the heap grows in backward).

Peaks (2 ranks, glibc defaults, trials in fresh processes from
``scripts/bench.py --config largest``'s trial code): at 24 blocks of width
1,280, 3,916 MB per rank with the trims (gated or at every unit) against
the plan's 3,805 (-2.8%), 4,338-4,441 MB with the trims off (-12 to -14%);
at 36 blocks 5,719 MB against 5,607 (-2.0%); at 16 blocks, sequence 256
(326M), 2,747 MB against 2,607 (-5.1%). What remains is a part that is
not tensors, 110-140 MiB per rank at every size, not explained (the
mapped library code grows by about 16 MB of it). On the whole machine 71
blocks fit against 64 before (the library trimming at every unit; plan
within 1.1% at 71 blocks). ``COMPOSABLE_SHARD_TRIM_HOST_MEMORY=0`` turns
it off (the peak then exceeds the plan by what the heap keeps). Where the C
library has no ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable

__all__ = ["ENV_SWITCH", "HostMemoryTrimmer", "malloc_trim", "resident_and_high_water", "trimming_enabled"]

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

    def __init__(
        self,
        trim_every_bytes: int | None = None,
        read_levels: Callable[[], tuple[int, int] | None] = resident_and_high_water,
    ) -> None:
        self.trim_every_bytes = self.TRIM_EVERY_BYTES if trim_every_bytes is None else trim_every_bytes
        self._read_levels = read_levels
        self._bytes_since_trim = 0
        self.trims = 0  # how many trims ran (tests and the bench read it)

    def unit_backward_starts(self, gathered_bytes: int) -> None:
        """A unit's backward starts; it gathered ``gathered_bytes``."""
        self._bytes_since_trim += gathered_bytes
        if self._bytes_since_trim < self.trim_every_bytes:
            return
        levels = self._read_levels()
        if levels is not None:
            resident, high_water = levels
            if resident + self.REACH_PER_GATHERED_BYTE * gathered_bytes < high_water:
                return  # far from the peak: a trim now would only cost page faults
        trim = malloc_trim()
        if trim is not None:
            trim()
            self.trims += 1
        self._bytes_since_trim = 0
