"""Owns: the shared-memory transport between the processes of one host
(all-gather, reduce-scatter, all-reduce and all-to-all through files in
``/dev/shm``, and shards published for a step), and its knobs,
``SLOT_BYTES`` and ``PUBLISHED_BYTES``.

Knows nothing of: the gloo/NCCL collectives, which collectives come here
and when a group sets up (``comm.transport``), parameters, modules,
streams.

The folder, one noun per module, in import order:

- ``eager.py``: the functions torch.compile runs eagerly (file I/O);
- ``stale.py``: where the files live (``COMPOSABLE_SHARD_SHM_DIR``), names
  that say their maker, the sweep of files whose maker is gone ([Note:
  stale files]);
- ``files.py``: the group's files: setup agreed by every rank, reservation,
  mapping, removal ([Note: shared-memory setup]);
- ``futex.py``: sleeping until a peer writes a header entry, and waking
  the ranks that sleep on one ([Note: waking a waiting peer]);
- ``slots.py``: rounds, slots, waits for peers, liveness and timeouts,
  ``SharedMemoryWork`` ([Note: slots and waits]);
- ``published.py``: ``PublishedShards``: the shards a rank publishes once a
  step, and all-gathers that read them where they lie ([Note: published shards]);
- ``collectives.py``: ``HostSharedMemory``: all-gather, reduce-scatter, all-reduce
  and all-to-all as rounds ([Note: shared-memory collectives], [Note:
  shared-memory all-to-all]).

Public names: ``HostSharedMemory``, ``PublishedShards``, ``SharedMemoryWork``,
``SharedMemoryUnavailable``, ``PLATFORM_SUPPORTED``, ``SLOTS``,
``SLOT_BYTES``, ``PUBLISHED_BYTES``, ``slot_reservation``, ``bytes_per_rank``,
``outside_graph``, ``eagerly``, ``prepare_for_compile``.
"""

from __future__ import annotations

from .collectives import HostSharedMemory
from .eager import eagerly, outside_graph
from .published import PublishedShards
from .files import PLATFORM_SUPPORTED, SLOTS, SharedMemoryUnavailable, bytes_per_rank, slot_reservation
from .slots import SharedMemoryWork, prepare_for_compile

__all__ = [
    "HostSharedMemory",
    "PublishedShards",
    "SharedMemoryWork",
    "SharedMemoryUnavailable",
    "PLATFORM_SUPPORTED",
    "SLOTS",
    "SLOT_BYTES",
    "PUBLISHED_BYTES",
    "slot_reservation",
    "bytes_per_rank",
    "outside_graph",
    "eagerly",
    "prepare_for_compile",
]

# The most bytes one rank writes into one slot; an operation that moves more
# streams through its slots in rounds. Read from here when a group sets up
# (``comm.transport`` passes it; rank 0's value holds for the group), so
# setting it before then changes the slots (docs/design/comm.md: why 2 MiB).
SLOT_BYTES = 2 << 20

# The most bytes of shards one rank publishes per group for a step's
# all-gathers ([Note: published shards] in published.py), where the shards
# then live in place of their own memory: the flat parameters claim slices
# in the order they are built until it is full; read as each one is built
# (0 switches publishing off).
PUBLISHED_BYTES = 64 << 20
