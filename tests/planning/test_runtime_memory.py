"""The plan's non-tensor line (``rank_bytes["runtime"]``,
composable_shard/planning/runtime_memory.py): glibc's mmap threshold as the
model computes it against the C library itself, and the line's dependence
on the sizes of a step's allocations, the transport and the device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import composable_shard as cs
from composable_shard.comm import transport
from composable_shard.planning.runtime_memory import (
    GLOO_THREADS,
    MMAP_THRESHOLD_MAX,
    MMAP_THRESHOLD_START,
    REST_ACTIVATION_CAP_BYTES,
    REST_BYTES,
    REST_PER_ACTIVATION_BYTE,
    TRIM_PER_THRESHOLD,
    mmap_threshold,
    runtime_memory,
)

from tests.support.models import Block, TinyGPT

MIB = 2**20

# Runs in a fresh interpreter without torch (its own frees would move the
# threshold): frees allocations of the given sizes, then checks that an
# allocation 8 KiB above the predicted threshold is mmapped and one 8 KiB
# below is not (mallinfo2's hblkhd: bytes in mmapped chunks).
_PROBE = r"""
import ctypes, json, sys
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
def alloc(size):  # as PyTorch's CPU allocator: 64-byte aligned
    pointer = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(pointer), ctypes.c_size_t(64), ctypes.c_size_t(size)) == 0
    return pointer
results = []
for freed, predicted in json.loads(sys.argv[1]):
    for size in freed:
        libc.free(alloc(size))
    mapped = libc.mallinfo2().hblkhd
    above = alloc(predicted + 8192)  # kept: a free would raise the threshold
    above_mapped = libc.mallinfo2().hblkhd - mapped
    below = alloc(predicted - 8192)
    below_mapped = libc.mallinfo2().hblkhd - mapped - above_mapped
    results.append([above_mapped > predicted, below_mapped == 0])
print(json.dumps(results))
"""


def test_mmap_threshold_is_the_largest_freed_chunk_up_to_32_mib_as_glibc_keeps_it() -> None:
    assert mmap_threshold([]) == mmap_threshold([100 * 1024]) == MMAP_THRESHOLD_START  # below the start: no change
    # One process frees each scenario's sizes in turn: the threshold after
    # a scenario is the model's for everything freed so far. (The
    # interpreter's start leaves a free heap top that may serve a probe
    # near 128 KiB, so the probes start at 3 MiB.)
    scenarios = [[3 * MIB], [2 * MIB, 40 * MIB], [9 * MIB + 123, 5 * MIB]]
    cases, freed_so_far = [], []
    for freed in scenarios:
        freed_so_far += freed
        cases.append((freed, mmap_threshold(freed_so_far)))
    assert cases[1][1] == cases[0][1] > 3 * MIB  # 2 MiB is below the threshold, 40 MiB above the cap
    assert 9 * MIB < cases[2][1] <= MMAP_THRESHOLD_MAX
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True, text=True, check=True)
    for (freed, predicted), (above_mapped, below_in_heap) in zip(cases, json.loads(out.stdout)):
        assert above_mapped, f"after frees of {freed}: {predicted + 8192} bytes were not mmapped"
        assert below_in_heap, f"after frees of {freed}: {predicted - 8192} bytes were mmapped"


def _mlp_stack(width: int, hidden: int, depth: int = 2) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[Block(width, hidden) for _ in range(depth)])


def _plan(model: nn.Module) -> cs.ShardingPlan:
    return cs.plan(model, world_size=2, policy={Block}, device="cpu", optimizer="adamw")


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "gloo"])
def test_runtime_line_follows_the_largest_freed_allocation_up_to_glibcs_cap(
    shared_memory: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main arena keeps up to twice the threshold on its heap's top;
    the threshold follows the largest allocation of at most 32 MiB the step
    frees (here a unit's gathered flat parameter), not the depth (which
    adds the per-unit rest only); through gloo its worker threads' arenas
    keep their buffers (a unit's flat copies) while the heap serves them."""
    monkeypatch.setenv(transport.ENV_SWITCH, "1" if shared_memory else "0")
    gloo = not (shared_memory and transport.PLATFORM_SUPPORTED)
    lines = []
    for hidden in (1024, 4096):  # a unit gathers 4 MiB, then 16 MiB (width 512, fp32)
        planned = _plan(_mlp_stack(512, hidden))
        unit_bytes = planned.units[-1].padded_numel * 4  # the gathered flat parameter (padded)
        threshold = mmap_threshold([unit_bytes])
        assert planned.runtime.threshold == threshold
        # Each gloo worker: an all-gather's copy and a reduction's buffer of a unit.
        assert planned.runtime.heap_tops == TRIM_PER_THRESHOLD * threshold + (GLOO_THREADS * 2 * unit_bytes if gloo else 0)
        # 4 more units: nothing grows (no input, so no activations for the rest to follow)
        deeper = _plan(_mlp_stack(512, hidden, 6)).runtime
        assert deeper == planned.runtime and deeper.rest == REST_BYTES
        lines.append(planned.rank_bytes["runtime"])
    assert lines[1] - lines[0] >= TRIM_PER_THRESHOLD * 12 * MIB  # the unit grew by 12 MiB
    # A 48 MiB unit is mmapped whatever the threshold (above the cap): the
    # largest freed allocation below the cap sets it, the sharded gradient
    # (24 MiB and a bit: zero_grad frees it), and gloo's copies of the
    # whole unit do not come from the workers' heaps.
    capped = _plan(_mlp_stack(512, 12288))
    assert capped.units[-1].padded_numel * 4 > MMAP_THRESHOLD_MAX
    assert capped.runtime.threshold == mmap_threshold([capped.units[-1].shard_numel * 4])
    assert capped.runtime.heap_tops == TRIM_PER_THRESHOLD * capped.runtime.threshold


def test_runtime_line_is_zero_on_cuda() -> None:
    """On CUDA the plan is compared with the caching allocator's tensors (never measured here)."""
    planned = cs.plan(_mlp_stack(64, 128), world_size=2, policy={Block}, device="cuda")
    assert planned.rank_bytes["runtime"] == planned.runtime.total == 0


def test_runtime_rest_follows_the_activation_peak_up_to_its_cap() -> None:
    """The rest (holes the heap keeps between live chunks) follows what the
    forward saves, the plan's activation peak, not the number of units;
    past the cap the backward's heap trims bound it ([Note: the memory that
    is not tensors])."""
    rests, peaks = [], []
    for n_blocks in (2, 6):
        planned = cs.plan(TinyGPT(n_blocks=n_blocks), world_size=2, policy={Block}, device="cpu", input_shape=(4, 6))
        peak = planned.rank_bytes["activations_peak"]
        assert 0 < peak < REST_ACTIVATION_CAP_BYTES
        assert planned.runtime.rest == REST_BYTES + int(REST_PER_ACTIVATION_BYTE * peak)
        rests.append(planned.runtime.rest)
        peaks.append(peak)
    assert peaks[1] > peaks[0] and rests[1] > rests[0]
    capped = [runtime_memory("cpu", activations=n * REST_ACTIVATION_CAP_BYTES).rest for n in (1, 3)]
    assert capped[0] == capped[1] == REST_BYTES + int(REST_PER_ACTIVATION_BYTE * REST_ACTIVATION_CAP_BYTES)
    assert runtime_memory("cuda", activations=REST_ACTIVATION_CAP_BYTES).rest == 0
