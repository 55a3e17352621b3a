"""Owns: the memory a training rank holds beyond its tensors, counted by
the plan as its own line (``rank_bytes["runtime"]``): a model of what the
C allocator (glibc) keeps, given the sizes of the step's allocations.

Knows nothing of: models, the step's replay (``sharding_plan.py`` gives
it the sizes: ``freed_allocation_sizes`` and ``gloo_buffer_sizes`` in
memory.py, and the number of units).

[Note: the memory that is not tensors]
``scripts/bench.py`` measures a rank's peak as the growth of its resident
set (VmHWM) over its level before the model is built. Beyond the plan's
tensors it holds (``python scripts/bench.py runtime-memory`` splits it
with ``/proc/self/status`` and ``mallinfo2``, per rank):

- ``code``: pages of torch's libraries first touched by the steps
  (``RssFile`` growth: the subcommand's ``code``), 18.5 MiB at every
  size and transport measured;
- ``heap_tops``: free memory glibc keeps on top of its heaps. A tensor
  below the mmap threshold comes from the heap of the allocating thread's
  arena; the threshold starts at 128 KiB and, each time an mmapped chunk
  of at most 32 MiB is freed, rises to that chunk's size, with the trim
  threshold at twice it; a heap's free top is handed back only above the
  trim threshold. So the main thread's arena (the steps' tensors; CPU
  autograd runs there) keeps up to ``2 x threshold``, the threshold being
  the largest allocation of at most 32 MiB the rank frees
  (``mmap_threshold``, checked against glibc itself). Through gloo each
  of ProcessGroupGloo's 2 worker threads allocates a collective's flat
  copies from its own arena while the heap serves them: up to two of a
  unit's copies each (an all-gather's and a reduction's);
- ``rest``: holes the step's order of allocations leaves between live
  chunks, Python objects, autograd's records. Not derived: 26.5 MiB plus
  1.66 MiB per unit, fitted on the bench GPT of width 256 at 2 and 16
  blocks through shared memory (``python scripts/bench.py runtime-memory
  --fit-rest`` prints the two numbers); it does not follow the width
  (512, 768, 1,280 validate it: ``--n-embd``).

Measured against the plan (``scripts/bench.py runtime-memory`` per point;
the table and its commands in docs/benchmarks.md): through shared memory
every point of the grid (width 256 to 1,280, 2 to 16 blocks, 326M) within
3.1%, the largest models within 1%; through gloo within 8% except with units of 12-27 MiB, where
the workers' arenas keep several units' copies more (the plan up to 22%
below). CUDA: the plan is compared with the caching allocator's bytes,
which hold tensors only, so the line is 0 there (the CUDA context and host
memory are outside what the plan predicts; never measured here, no GPU).
Pinned by tests/planning/test_runtime_memory.py and tests/planning/test_plan.py
(test_runtime_memory_is_its_own_line_of_the_total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["RuntimeMemory", "runtime_memory", "mmap_threshold"]

_MIB = 2**20
_PAGE = 4096

# Pages of torch's libraries first touched by a training step (RssFile growth
# after 3 steps: 18.5 MiB at 7.4M and 326M, gloo and shared memory). Measured
# by `python scripts/bench.py runtime-memory` (its "code" per rank).
CODE_BYTES = int(18.5 * _MIB)
# glibc on 64-bit Linux: M_MMAP_THRESHOLD starts at 128 KiB and rises with
# frees of mmapped chunks up to DEFAULT_MMAP_THRESHOLD_MAX; the trim
# threshold follows at twice it (malloc.c, free of an mmapped chunk).
MMAP_THRESHOLD_START = 128 * 1024
MMAP_THRESHOLD_MAX = 32 * _MIB
TRIM_PER_THRESHOLD = 2
# ProcessGroupGloo's worker threads per group (its default), one arena each
# (torch's ProcessGroupGloo.Options threads; not measured, a default).
GLOO_THREADS = 2
# The rest, per rank and per unit: fitted on the bench GPT of width 256 at 2
# and 16 blocks through shared memory, torch 2.13, glibc defaults; refit
# with `python scripts/bench.py runtime-memory --fit-rest` (prints both).
REST_BYTES = int(26.5 * _MIB)
REST_PER_UNIT_BYTES = int(1.66 * _MIB)


@dataclass(frozen=True)
class RuntimeMemory:
    """A rank's non-tensor memory at the step's peak, by part (bytes; see
    [Note: the memory that is not tensors]). ``threshold``: glibc's mmap
    threshold after the first step; ``arenas``: the arenas whose kept tops
    ``heap_tops`` counts."""

    code: int = 0
    rest: int = 0
    heap_tops: int = 0
    threshold: int = 0
    arenas: int = 0

    @property
    def total(self) -> int:
        return self.code + self.rest + self.heap_tops


def _chunk_bytes(request: int) -> int:
    """The size of the chunk glibc maps for a ``request``-byte allocation,
    which a free sets the threshold to: PyTorch's CPU allocator asks for
    64-byte alignment (``posix_memalign``), so glibc maps the request, the
    alignment slack and the headers rounded up to pages (+120 bytes) and
    the chunk starts 48 bytes in, at the aligned address."""
    return -(-(request + 120) // _PAGE) * _PAGE - 48


def mmap_threshold(freed: Iterable[int]) -> int:
    """glibc's mmap threshold after allocations of the sizes ``freed``
    (bytes) were made and freed once: the largest chunk of at most 32 MiB
    among them (each was mmapped while the threshold was below it, and its
    free raised the threshold to it), at least the starting 128 KiB."""
    chunks = [_chunk_bytes(n) for n in freed if n > 0]
    return max([MMAP_THRESHOLD_START, *(c for c in chunks if c <= MMAP_THRESHOLD_MAX)])


def runtime_memory(
    device_type: str, *, freed: Iterable[int] = (), gloo_buffers: Iterable[int] = (), units: int = 0
) -> RuntimeMemory:
    """The model of [Note: the memory that is not tensors] for a rank on
    ``device_type``: ``freed`` the sizes (bytes) of the tensors a step
    allocates and frees (every one, or at least the largest of each kind),
    ``gloo_buffers`` the sizes of the flat copies gloo's worker threads
    make (empty through shared memory or without collectives), ``units``
    how many units the model has."""
    if device_type != "cpu":
        return RuntimeMemory()
    gloo = [n for n in gloo_buffers if n > 0]
    threshold = mmap_threshold([*freed, *gloo])
    kept_top = TRIM_PER_THRESHOLD * threshold
    heap_tops, arenas = kept_top, 1  # the main thread's arena
    served = [n for n in gloo if n < threshold]
    if served:  # below the threshold a buffer comes from the worker's heap, which
        # holds an all-gather's copy and a reduction's buffer at most at once
        heap_tops += GLOO_THREADS * min(kept_top, 2 * max(served))
        arenas += GLOO_THREADS
    rest = REST_BYTES + REST_PER_UNIT_BYTES * units
    return RuntimeMemory(CODE_BYTES, rest, heap_tops, threshold, arenas)
