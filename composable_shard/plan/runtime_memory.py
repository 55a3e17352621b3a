"""Owns: the memory a rank holds beyond its tensors during training — a
constant measured per device and transport, counted by the plan as its own
line (``rank_bytes["runtime"]``).

Knows nothing of: models, units, the step's replay (memory.py).

[Note: the memory that is not tensors]
``scripts/bench.py`` measures a rank's peak as the growth of its resident
set (VmHWM) over its level before the model is built — after
``init_process_group``, the imports and the data. The plan's tensors fall
short of it; benchmarks/runtime_2026-11-25/measure_runtime.py splits the
difference (``/proc/self/status`` and glibc's ``mallinfo2`` before
building and after each step; 2 ranks, torch 2.13, glibc defaults; the
table is in docs/benchmarks.md):

- code and data pages of torch's libraries first touched by the steps
  (``RssFile`` growth: kernels, autograd, the optimizer): 18.5 MiB at
  every size and transport;
- what glibc keeps after the step's transients are freed (chunks below
  its mmap threshold stay in the heap: 75-114 MiB free after 3 steps at
  7.4M, 333-390 MiB at 326M), part of which the peak's own transients
  reuse — the largest part, and it grows with the transients' sizes;
- the rest (Python objects, autograd's graph, hooks' records) is a few
  MiB beside them; no thread starts after the baseline (gloo's and the
  intra-op pool's start with the process group), so no new stack.

The parts cannot be told apart at the peak moment itself (the allocator
serves the peak's transients from its kept chunks), so the plan counts
one constant per device and transport, the measured peak less the plan's
tensors at the bench's configuration for that transport: through gloo,
83-98 MiB at 7.4M (8 x 256, the bench's gloo row); through shared
memory, 120-127 MiB at 326M (16 x 1,280). It is an estimate where
sizes differ: through shared memory at 7.4M the difference was 67-70
MiB. On CUDA the plan is compared with the caching allocator's bytes,
which hold tensors only: the constant there is 0 (the CUDA context and
the host's memory are outside what the plan predicts; never measured
here, no GPU). Pinned by tests/plan/test_plan.py
(test_runtime_memory_is_its_own_line_of_the_total).
"""

from __future__ import annotations

__all__ = ["runtime_bytes", "RUNTIME_BYTES"]

_MIB = 2**20

# (device type, through the shared-memory transport) -> bytes per rank.
RUNTIME_BYTES: dict[tuple[str, bool], int] = {
    ("cpu", False): 88 * _MIB,  # gloo: 83-98 MiB measured at 7.4M
    ("cpu", True): 124 * _MIB,  # shared memory: 120-127 MiB measured at 326M
}


def runtime_bytes(device_type: str, shared_memory: bool) -> int:
    """The non-tensor memory of a training rank on ``device_type`` (see
    [Note: the memory that is not tensors]); 0 where it was not measured."""
    return RUNTIME_BYTES.get((device_type, shared_memory), 0)
