"""Owns: measuring a real step's memory at every runtime hook, to draw over
the plan's timeline (``ShardingPlan.plot(path, measured=recorder.record)``)
— on CUDA the caching allocator's ``memory_allocated``, on the CPU the
process's resident set and the tensors the runtime owns; each relative to
the level when the recorder was made.

Knows nothing of: the plan's arithmetic, drawing. The runtime only calls
the sampler installed here ([Note: sampling memory at the hooks]).

Public names: ``MemoryRecorder``, ``MemoryRecord``, ``MemorySample``.

[Note: sampling memory at the hooks]
Off by default: each hook checks one module global
(``runtime/memory_samples.py``). While ``MemoryRecorder.record()`` runs,
every hook, once done, appends a sample named as the hook is
(``"pre_forward (blocks.0)"``). On CUDA a sample is
``torch.cuda.memory_allocated`` (no synchronize: the allocator's count is
the host's, kept as the kernels are queued). On the CPU it is RSS from
``/proc/self/statm`` (a read of a few bytes) and the bytes of the storages
the runtime owns. Make the recorder before building the model (after
``init_process_group`` and imports) so both count the model state the plan
counts; RSS also counts the allocator's free pages and whatever else the
process allocated. Making it imports ``torch._dynamo`` first, which
``torch.optim``'s first optimizer imports otherwise (26 MiB of RSS,
torch 2.13): a library's import is not the step's memory, which the plan
counts (``scripts/bench.py`` imports every library before its baseline
too). Never ran on CUDA here (no GPU).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..runtime import memory_samples
from ..runtime.state import UnitState

__all__ = ["MemoryRecorder", "MemoryRecord", "MemorySample"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the resource module's high-water mark is all there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class MemorySample:
    """One hook: its name, the device's or process's bytes above the
    recorder's baseline, and (CPU) the runtime's own tensors."""

    label: str
    bytes: int
    runtime_bytes: int | None = None


@dataclass
class MemoryRecord:
    """The samples of one ``record()``; ``kind``: ``"allocated"`` (CUDA) or
    ``"RSS"`` (CPU)."""

    kind: str
    samples: list[MemorySample] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max((s.bytes for s in self.samples), default=0)


class MemoryRecorder:
    """Make it before the model is built; ``with recorder.record() as
    record:`` around one training step fills ``record.samples``. See
    [Note: sampling memory at the hooks]."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.kind = "allocated" if self.device.type == "cuda" else "RSS"
        # Imported before the baseline, as an optimizer's construction would
        # after it ([Note: sampling memory at the hooks]).
        importlib.import_module("torch._dynamo")
        self.baseline = self._level()

    def _level(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _rss_bytes()

    @contextlib.contextmanager
    def record(self) -> Iterator[MemoryRecord]:
        """Sample at every hook of every sharded model in this process while
        the block runs (one recording at a time)."""
        result = MemoryRecord(self.kind)
        cpu = self.device.type != "cuda"

        def sample(state: UnitState, hook: str) -> None:
            owned = memory_samples.runtime_tensor_bytes(state) if cpu else None
            result.samples.append(MemorySample(f"{hook} ({state.fqn})", self._level() - self.baseline, owned))

        previous = memory_samples.set_sampler(sample)
        if previous is not None:
            memory_samples.set_sampler(previous)
            raise RuntimeError("MemoryRecorder.record(): another recording is running; end it first.")
        try:
            yield result
            result.samples.append(MemorySample("end of step", self._level() - self.baseline))
        finally:
            memory_samples.set_sampler(None)
