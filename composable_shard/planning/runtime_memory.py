"""Owns: the memory a training rank holds beyond its tensors, counted by
the plan as its own line (``rank_bytes["runtime"]``): a model of what the
C allocator (glibc) keeps, given the sizes of the step's allocations.

Knows nothing of: models, the step's replay (``sharding_plan.py`` gives
it the sizes: ``freed_allocation_sizes`` and ``gloo_buffer_sizes`` in
memory.py, and the step's activation peak).

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
  chunks: a forward's saved tensors are allocated between its
  temporaries, which it frees, and the backward frees the saved tensors
  between its own live gradients, so the heap keeps free chunks in
  proportion to what the forward saves, up to a point: past about 130 MiB
  of activations it stopped growing (measured, not explained; the
  backward's heap trims, runtime/host_memory.py, run more often in
  larger backwards and are the likely reason). Not derived: 1.6 MiB plus
  0.247 of the step's activation peak (``ActivationProfile.peak``) up to
  ``REST_ACTIVATION_CAP_BYTES``, fitted by least squares on two measurements
  of the 16 points of ``python scripts/bench.py runtime-memory --fit-rest``
  (through shared memory: widths 64 to 1,280, 2 to 64 blocks, 2 to 16
  sequences, activation peaks 9 to 133 MiB; one run alone gave 1.0 MiB +
  0.264, the other 2.2 MiB + 0.23). The points' rests were -9.5 to 51.2
  MiB, most within 5 MiB of the line (the ranks of one point differ by up
  to 40); 326M, with 326.6 MiB of activations, kept 26.6 to 37.2 in two
  runs, the cap's 33.7. A rest of 26.5 MiB plus 1.66 MiB per unit, fitted
  before on two points of width 256, said 97.6 MiB too much for 64 blocks
  of width 64: the rest follows what the forward saves, not the units. A
  plan without an input knows no activations and counts the constant only.

Measured against the plan (``scripts/bench.py runtime-memory`` per point;
the table and its commands in docs/benchmarks.md): through shared memory
the grid (width 64 to 1,280, 2 to 64 blocks, 326M) within -9.9% to
+9.5%, the bench GPT (7.4M) and 326M within 2.3%, the extremes being the
rest's noise on small totals; through gloo within 5% today, where units
of 12-27 MiB have had the workers' arenas keep several units' copies
more (the plan up to 22% below). CUDA: the plan is compared with the caching allocator's bytes,
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
# The rest, per rank and per byte of the step's activation peak: fitted on
# two measurements of the 16 points of `python scripts/bench.py
# runtime-memory --fit-rest` (shared memory, torch 2.13, glibc defaults; it
# prints its own fit).
REST_BYTES = int(1.6 * _MIB)
REST_PER_ACTIVATION_BYTE = 0.247
# Activations beyond which the rest stopped growing (326M: 326.6 MiB of
# activations kept no more than the 130 MiB points).
REST_ACTIVATION_CAP_BYTES = 130 * _MIB


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
    device_type: str, *, freed: Iterable[int] = (), gloo_buffers: Iterable[int] = (), activations: int = 0
) -> RuntimeMemory:
    """The model of [Note: the memory that is not tensors] for a rank on
    ``device_type``: ``freed`` the sizes (bytes) of the tensors a step
    allocates and frees (every one, or at least the largest of each kind),
    ``gloo_buffers`` the sizes of the flat copies gloo's worker threads
    make (empty through shared memory or without collectives),
    ``activations`` the step's activation peak (bytes; 0 where unknown)."""
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
    rest = REST_BYTES + int(REST_PER_ACTIVATION_BYTE * min(activations, REST_ACTIVATION_CAP_BYTES))
    return RuntimeMemory(CODE_BYTES, rest, heap_tops, threshold, arenas)
