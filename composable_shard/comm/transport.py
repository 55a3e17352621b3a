"""Owns: which transport carries a collective: shared memory (CPU tensors of
a gloo group whose ranks share a host) or messages through the process
group's backend, and which method reduces a gradient.

Knows nothing of: how either transport moves bytes (``shared_memory``,
``process_group``), modules, flat parameters, streams.

Public names: ``host_transport``, ``uses_shared_memory``,
``reduce_scatter_method``, ``inputs_in_use``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group, shared_memory
from .shared_memory import HostSharedMemory, SharedMemoryWork

__all__ = ["host_transport", "uses_shared_memory", "reduce_scatter_method", "inputs_in_use"]


def host_transport(tensor: torch.Tensor, group: ProcessGroup | None) -> HostSharedMemory | None:
    """The shared-memory transport that carries ``tensor``'s collectives over
    ``group``, or None where they go through the backend."""
    # Under torch.compile, gloo's collectives, which dynamo traces: the
    # shared-memory path's file I/O would break the graph at every call.
    if tensor.device.type != "cpu" or torch.compiler.is_compiling() or not shared_memory.enabled():
        return None
    return HostSharedMemory.for_group(group)


def uses_shared_memory(group: ProcessGroup | None, device_type: str) -> bool:
    """Whether collectives of ``group`` on ``device_type`` go through shared
    memory, without a collective (for memory plans); see
    ``shared_memory.expected``."""
    return shared_memory.expected(group, device_type)


def inputs_in_use(work: Any) -> bool:
    """Whether the backend may still read a collective's inputs until its
    work is waited on (False for shared-memory work, which copied them out
    when it was issued, so their memory can be freed at once)."""
    return not isinstance(work, SharedMemoryWork)


def reduce_scatter_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """How ``comm.reduce_scatter`` reduces ``input`` over ``group``.

    [Note: gradient collective per backend]
    NCCL (and any backend but gloo): a reduce-scatter, which moves each byte
    once. gloo on CPU with every rank on one host: shared memory (measured in
    [Note: shared-memory collectives], comm/shared_memory.py: about half the
    time and CPU of the all-reduce below). Other gloo groups on CPU: an in-place all-reduce of the whole input, keeping this
    rank's chunk. gloo's reduce-scatter copies its whole input before
    reducing and reaches about half the bus bandwidth of its all-reduce, so
    the all-reduce is faster although it moves twice the bytes. Measured with
    ``scripts/bench_comm.py`` (world size 2, one thread per rank, 2 shared
    cores under load, 40 calls each interleaved), all-reduce + chunk copy /
    reduce-scatter median time: 0.92 at 1 MiB, 0.80 at 4 MiB, 0.81 at
    16 MiB, although the all-reduce side also paid a full copy of its input
    there; the handle's reduction on this path / raw reduce-scatter: 0.95,
    0.79, 0.74. (An all-gather done as an all-reduce was slower at 1 and
    4 MiB, so all-gathers stay all-gathers.) It costs no memory: the
    padded gradient exists anyway and is freed after the reduction, and the
    chunk is copied out of it (``ChunkOfAllReduce``), never kept as a view
    that would hold the whole buffer alive.
    """
    if host_transport(input, group) is not None:
        return "shared_memory"
    return process_group.message_method(input, group)
