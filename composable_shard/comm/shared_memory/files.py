"""Owns: the files of one group's shared memory in ``/dev/shm``: deciding at
setup, alike on every rank, whether the group can use them; creating,
reserving and opening them (and a pidfd of every peer); removing their
names; mapping slots into this process; closing them; and what they cost.

Knows nothing of: what the slots' bytes mean (``slots``: rounds, waits;
``collectives``: all-gather, reduce-scatter), which groups use shared
memory (``comm.transport``), parameters, modules, streams.

Public names: ``GroupFiles``, ``SharedMemoryUnavailable``,
``PLATFORM_SUPPORTED``, ``SLOTS``, ``HEADER``, ``ARRIVED_ENTRY``,
``PUBLISHED_ENTRY``, ``CLOSED_ENTRY``, ``CLOSED_ENTRIES``, ``slot_reservation``, ``bytes_per_rank``,
``TEST_SETUP_PAUSE_ENV``.

[Note: shared-memory setup]
Setup (``GroupFiles.open``, collective, once per group): the ranks exchange
their facts over the backend (host, ``/dev/shm`` mount and pid namespace;
pid; free bytes in ``/dev/shm``; their switch) and decide alike: shared
memory only if every rank wants it, all share one host's ``/dev/shm`` and
pid numbers, and each has room for every rank's slots; else
``SharedMemoryUnavailable`` on every rank. File names derive from rank 0's
pid and a token it sent, and end with their maker's pid, start time and pid
namespace (``stale``), so every rank knows every name before any file
exists, and a later setup can tell a dead job's leftovers from a live
one's. Each rank creates and reserves its file, opens its peers' files and
pidfds (each step agreed over the backend); then, or on any failure, every
rank removes every name: the files live only as long as a process holds
them, and nothing is left in ``/dev/shm`` whatever fails that a rank
survives. Where every rank dies in that window, the next setup on the host
removes the files ([Note: stale files] in stale.py): each rank sweeps the
directory before it measures the free space.

Each slot reserves (``posix_fallocate``) the largest collective announced
before setup, up to the slot size (``slot_reservation``), and grows up to it
before a write that needs more, so a full ``/dev/shm`` is an error naming
the fix, not a SIGBUS. After the slots lies the area of the shards this
rank publishes ([Note: published shards] in published.py), as many bytes
as the group's flat parameters announced before setup, reserved at
creation; where ``/dev/shm`` has room for the slots but not for it too, or
the ranks announced different sizes, every rank goes without it (0 bytes). ``shared_bytes`` is what this rank's file holds;
``mapped_bytes`` what this process's RSS counts (peers' slots included).
Pinned by tests/comm/test_shared_memory.py
(test_shared_memory_files_close_and_unmap_when_their_group_is_destroyed,
test_group_falls_back_to_gloo_with_one_warning_when_dev_shm_lacks_space,
test_group_with_one_rank_unable_falls_back_to_gloo_on_every_rank) and
tests/comm/test_failures.py (a peer killed during setup).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import sys
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .stale import file_name, owner_marker, shm_directory, sweep_stale_files

__all__ = [
    "GroupFiles",
    "SharedMemoryUnavailable",
    "PLATFORM_SUPPORTED",
    "SLOTS",
    "HEADER",
    "ARRIVED_ENTRY",
    "PUBLISHED_ENTRY",
    "CLOSED_ENTRY",
    "CLOSED_ENTRIES",
    "slot_reservation",
    "bytes_per_rank",
    "TEST_SETUP_PAUSE_ENV",
]

# Test only: seconds each rank sleeps in setup once its file has a name
# (tests/comm/test_stale_files.py kills every rank there).
TEST_SETUP_PAUSE_ENV = "COMPOSABLE_SHARD_TEST_SETUP_PAUSE_S"
# Slots per rank's file; rounds take them round-robin (see ``slots``).
SLOTS = 4
# The file's first page: per slot, the last round this rank finished reading
# from its peers; then per slot a pair: the signature (kind and size) of the
# last round this rank wrote, and its number; then the published shards'
# entries ([Note: published shards] in published.py): the last publish this
# rank arrived at, the pair (signature, number) of the last one whose
# shards it wrote, and a ring of ``CLOSED_ENTRIES`` entries: in entry
# ``n % CLOSED_ENTRIES``, the last publish of that residue whose step
# ended here. Zeroed at creation.
CLOSED_ENTRIES = 4
HEADER = struct.Struct(f"<{3 * SLOTS + 3 + CLOSED_ENTRIES}q")
ARRIVED_ENTRY = 3 * SLOTS
PUBLISHED_ENTRY = 3 * SLOTS + 2
CLOSED_ENTRY = 3 * SLOTS + 3  # the ring's first entry
# Slot regions are reserved and mapped in multiples of this, so that units
# of slightly different sizes share one mapping.
_MAP_GRANULE = 1 << 16
_PAGE = mmap.PAGESIZE

# Shared memory needs a writer's stores to become visible to other cores in
# program order, and loads not reordered with older loads (see "Ordering"
# in [Note: slots and waits], slots.py): x86-64 on Linux.
PLATFORM_SUPPORTED = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


class SharedMemoryUnavailable(Exception):
    """The group cannot use shared memory; every rank of it raises this
    alike (the reasons were agreed over the backend). ``warn``: the ranks
    share a host, so the user expected the fast path and is told why not."""

    def __init__(self, reason: str, *, warn: bool) -> None:
        super().__init__(reason)
        self.warn = warn


@dataclass(frozen=True)
class RankFacts:
    """What one rank tells its peers at setup, all in one message."""

    # Equal on every rank that shares this host's /dev/shm and pid numbers:
    # the kernel's boot id, the files' directory (path and mount) and the
    # pid namespace.
    place: tuple[str, str, int, int]
    pid: int
    # Ends this rank's file name: its maker (``stale.owner_marker``).
    owner: str
    global_rank: int
    # Bytes free in /dev/shm (statvfs) before any rank reserved its slots;
    # None when this rank cannot write there.
    free_bytes: int | None
    # Names this setup's files (rank 0's is used).
    token: str
    # Bytes one slot holds on this rank (rank 0's is used).
    slot_bytes: int
    # This rank's switch (``COMPOSABLE_SHARD_SHARED_MEMORY``): off on any
    # rank means off for the group.
    wanted: bool
    # Bytes of shards this rank announced it publishes (every rank must
    # announce the same, or none publishes).
    published_bytes: int


class GroupFiles:
    """One group's files: this rank's, its peers', and a pidfd of each peer."""

    def __init__(
        self, rank: int, facts: list[RankFacts], fds: list[int], pidfds: dict[int, int], reserved: int, published: int
    ) -> None:
        self.rank = rank
        self.world_size = len(facts)
        # Every rank's setup facts (pids and global ranks name peers in errors).
        self.facts = facts
        # Rank -> the file descriptor of its file.
        self.fds = fds
        # Peer rank -> a pidfd of its process (readable once it exited).
        self.pidfds = pidfds
        # Bytes one slot holds (agreed: rank 0's) and where slot ``s`` starts
        # in every file: ``(s + 1) * stride``.
        self.slot_bytes = facts[0].slot_bytes
        self.stride = _stride(self.slot_bytes)
        # The directory the files were made in (named in errors).
        self.directory = facts[0].place[1]
        # Bytes reserved in this rank's file per slot (``posix_fallocate``).
        self._reserved = [reserved] * SLOTS
        # Bytes of the published shards' area, reserved at creation (0: none).
        self.published_bytes = published
        # (rank, slot) -> the mapping of that slot of that rank's file and a
        # uint8 tensor over it; replaced by a longer one when a round needs more.
        self._mappings: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}
        # (rank, slot) -> bytes touched through the mapping so far (resident
        # in this process: RSS counts them).
        self._touched: dict[tuple[int, int], int] = {}
        # Every rank's header page, mapped for the futexes the waits sleep on
        # ([Note: waking a waiting peer] in futex.py), and where it lies here.
        self._header_pages = [mmap.mmap(fd, _PAGE) for fd in fds]
        self.header_addresses = [_address_of(page) for page in self._header_pages]
        weakref.finalize(self, _close_all, list(fds) + list(pidfds.values()), self._mappings, self._header_pages)

    @classmethod
    def open(
        cls, group: ProcessGroup, largest_bytes: int, *, wanted: bool, slot_bytes: int, published_bytes: int = 0
    ) -> "GroupFiles":
        """Set up the files of ``group`` (collective: every rank of the group
        calls it, once), their slots reserved for collectives writing up to
        ``largest_bytes`` per rank, with an area of ``published_bytes`` for
        published shards where there is room; ``wanted``: this rank's switch;
        ``slot_bytes``: this rank's slot size (rank 0's holds). Raises
        ``SharedMemoryUnavailable`` on every rank alike where the group
        cannot use shared memory, and the backend's error where a peer fails
        meanwhile; no file of the group is left in ``/dev/shm`` either way."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        directory = shm_directory()
        sweep_stale_files(directory)  # before measuring the free space: leftovers hold some
        facts: list[Any] = [None] * world_size
        dist.all_gather_object(facts, _own_facts(wanted, slot_bytes, directory, published_bytes), group=group)
        _check_facts(facts, largest_bytes, directory)
        reserved = slot_reservation(largest_bytes, facts[0].slot_bytes)
        published = _published_grant(facts, largest_bytes)
        # Every path is known to every rank before any file exists, so
        # whichever rank survives a failure can remove them all.
        paths = [
            os.path.join(directory, file_name(facts[0].pid, facts[0].token, peer, facts[peer].owner))
            for peer in range(world_size)
        ]
        fds = [-1] * world_size
        pidfds: dict[int, int] = {}
        done = False
        try:
            error = None
            try:
                fds[rank] = _create_file(paths[rank], _stride(facts[0].slot_bytes), reserved, published)
            except OSError as failure:
                error = failure.strerror
            _pause_for_tests()
            _agree(group, error, "create and reserve", directory)
            try:
                for peer in range(world_size):
                    if peer != rank:
                        fds[peer] = os.open(paths[peer], os.O_RDWR)
                        pidfds[peer] = os.pidfd_open(facts[peer].pid)
            except OSError as failure:
                error = f"{failure.strerror} ({failure.filename or 'pidfd_open'})"
            _agree(group, error, "open", directory)
            done = True
        finally:
            # Every rank has every file open (or the setup failed): the names
            # can go; the files live as long as a process holds them.
            _unlink_quietly(paths)
            if not done:
                _close_all([fd for fd in fds if fd >= 0] + list(pidfds.values()))
        return cls(rank, facts, fds, pidfds, reserved, published)

    def region(self, rank: int, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot`` in ``rank``'s file, mapped into
        this process, as a uint8 tensor. This rank's own slot is reserved
        first (``posix_fallocate``), so a full ``/dev/shm`` is an error here
        rather than a SIGBUS at the first write through the mapping."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        key = (rank, slot)
        mapped = self._mappings.get(key)
        if mapped is None or mapped[1].numel() < nbytes:
            length = min(round_up(nbytes, _MAP_GRANULE), self.stride)
            if rank == self.rank:
                self._reserve(slot, length)
            region = mmap.mmap(self.fds[rank], length, offset=self.stride * (slot + 1))
            # The replaced mapping is unmapped once no tensor views it. Not
            # an inference tensor, though the first collective may run under
            # torch.inference_mode(): the mapping is cached and later written
            # outside it (test_inference_mode_forwards_change_nothing).
            with torch.inference_mode(False):
                view = torch.frombuffer(region, dtype=torch.uint8)
            mapped = self._mappings[key] = (region, view)
        if self._touched.get(key, 0) < nbytes:
            self._touched[key] = nbytes
        return mapped[1][:nbytes]

    def published_area(self, rank: int) -> torch.Tensor:
        """``rank``'s area of published shards (``published_bytes``, after its
        slots), mapped into this process once, as a uint8 tensor."""
        key = (rank, SLOTS)
        mapped = self._mappings.get(key)
        if mapped is None:
            region = mmap.mmap(self.fds[rank], self.published_bytes, offset=self.stride * (SLOTS + 1))
            with torch.inference_mode(False):  # as ``region``'s
                view = torch.frombuffer(region, dtype=torch.uint8)
            mapped = self._mappings[key] = (region, view)
            self._touched[key] = self.published_bytes  # every byte is written or read each step
        return mapped[1]

    def own_published_slice(self, at: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this rank's area from byte ``at``, as a uint8 tensor
        with a storage of its own (a shard kept there is compared with
        others by its storage: handle/writeback.py). The mapping stays
        while it lives, also after the group is gone (``_close_all``)."""
        self.published_area(self.rank)
        region = self._mappings[(self.rank, SLOTS)][0]
        with torch.inference_mode(False):  # as ``region``'s
            return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=at)

    def _reserve(self, slot: int, nbytes: int) -> None:
        if self._reserved[slot] >= nbytes:
            return
        try:
            os.posix_fallocate(self.fds[self.rank], self.stride * (slot + 1), nbytes)
        except OSError as error:
            raise RuntimeError(
                f"composable_shard shared-memory collective: cannot reserve {nbytes} bytes in {self.directory} "
                f"({error.strerror}), more than the group reserved at its setup. Free space there (Docker: "
                "--shm-size) or set COMPOSABLE_SHARD_SHARED_MEMORY=0 to use gloo."
            ) from error
        self._reserved[slot] = nbytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared memory this rank's file holds (its header's page,
        its slots' reservations and its published shards' area): at most
        ``bytes_per_rank`` of any size, since no slot grows past the slot size."""
        return _PAGE + sum(self._reserved) + self.published_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes every slot of this rank's file holds already (the least
        over its slots): what a round may write without growing the file."""
        return min(self._reserved)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of shared memory (this rank's files and its peers') this
        process touched through its mappings (every rank's header page
        among them): pages its RSS counts."""
        return len(self._header_pages) * _PAGE + sum(round_up(nbytes, _PAGE) for nbytes in self._touched.values())


def _address_of(page: mmap.mmap) -> int:
    """Where ``page`` is mapped in this process (the view that tells is
    dropped at once: a mapping something exports cannot be closed)."""
    view = (ctypes.c_char * len(page)).from_buffer(page)
    address = ctypes.addressof(view)
    del view
    return address


def round_up(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule


def _stride(slot_bytes: int) -> int:
    """How far apart slots lie in a file (sparse: the gaps cost nothing)."""
    return round_up(max(slot_bytes, 1), _MAP_GRANULE)


def slot_reservation(largest_bytes: int, slot_bytes: int) -> int:
    """Bytes reserved per slot at setup for collectives writing up to
    ``largest_bytes`` per rank: all of them while they fit one slot of
    ``slot_bytes``, else the whole slot, through which larger ones stream."""
    if largest_bytes <= 0:
        return 0
    return min(round_up(largest_bytes, _MAP_GRANULE), _stride(slot_bytes))


def bytes_per_rank(largest_bytes: int, slot_bytes: int, published_bytes: int = 0) -> int:
    """Shared memory one rank's file holds once set up for collectives
    writing up to ``largest_bytes`` per rank: its header's page and its
    slots' reservations (at most ``PAGE + SLOTS * slot_bytes``, rounded to
    the mapping granule, whatever the size), and ``published_bytes`` of
    published shards (rounded to the granule)."""
    return _PAGE + SLOTS * slot_reservation(largest_bytes, slot_bytes) + round_up(published_bytes, _MAP_GRANULE)


def _own_facts(wanted: bool, slot_bytes: int, directory: str, published_bytes: int) -> RankFacts:
    try:
        boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
        where = os.path.realpath(directory)
        place = (boot_id, where, os.stat(where).st_dev, os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        place = (uuid.uuid4().hex, directory, 0, 0)  # shares with nobody
    free: int | None = None
    if os.access(directory, os.W_OK):
        stats = os.statvfs(directory)
        free = stats.f_bavail * stats.f_frsize
    token = uuid.uuid4().hex
    return RankFacts(place, os.getpid(), owner_marker(), dist.get_rank(), free, token, slot_bytes, wanted, published_bytes)


def _pause_for_tests() -> None:
    pause = os.environ.get(TEST_SETUP_PAUSE_ENV)
    if pause:
        time.sleep(float(pause))


def _check_facts(facts: list[RankFacts], largest_bytes: int, directory: str) -> None:
    """Whether the group can share memory at all, decided alike on every
    rank from the facts every rank sent."""
    if any(not rank_facts.wanted for rank_facts in facts):
        off = [rank for rank, rank_facts in enumerate(facts) if not rank_facts.wanted]
        raise SharedMemoryUnavailable(f"shared memory is switched off on ranks {off}", warn=False)
    if any(rank_facts.place != facts[0].place for rank_facts in facts):
        raise SharedMemoryUnavailable(
            f"the ranks do not share one host's {directory} and process ids", warn=False
        )
    unwritable = [rank for rank, rank_facts in enumerate(facts) if rank_facts.free_bytes is None]
    if unwritable:
        raise SharedMemoryUnavailable(f"{directory} is not writable on ranks {unwritable}", warn=True)
    free_of = [rank_facts.free_bytes for rank_facts in facts if rank_facts.free_bytes is not None]  # every rank's
    per_slot = slot_reservation(largest_bytes, facts[0].slot_bytes)
    needed = bytes_per_rank(largest_bytes, facts[0].slot_bytes) * len(facts)
    short = [rank for rank, free_bytes in enumerate(free_of) if free_bytes < needed]
    if short:
        free = min(free_of[rank] for rank in short)
        raise SharedMemoryUnavailable(
            f"{directory} has {free / 2**20:.1f} MiB free on ranks {short}; the group needs {needed / 2**20:.1f} MiB "
            f"({len(facts)} ranks x {SLOTS} slots x {per_slot / 2**20:.1f} MiB). Free space there (Docker: "
            "--shm-size)",
            warn=True,
        )


def _published_grant(facts: list[RankFacts], largest_bytes: int) -> int:
    """Bytes of every rank's published shards' area, decided alike on every
    rank from the facts: what the ranks announced (rounded to the granule)
    where all announced the same and every rank has room for it beside the
    slots (``_check_facts`` saw room for those), else 0."""
    announced = facts[0].published_bytes
    if announced <= 0 or any(rank_facts.published_bytes != announced for rank_facts in facts):
        return 0
    area = round_up(announced, _MAP_GRANULE)
    needed = bytes_per_rank(largest_bytes, facts[0].slot_bytes, area) * len(facts)
    return area if all((rank_facts.free_bytes or 0) >= needed for rank_facts in facts) else 0


def _create_file(path: str, stride: int, reserved: int, published: int) -> int:
    """This rank's file, its header zeroed, every slot's ``reserved`` bytes
    and the ``published`` bytes of its published shards' area reserved
    (``posix_fallocate``: a full ``/dev/shm`` is an error here, not a
    SIGBUS at a later write through a mapping)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, bytes(HEADER.size), 0)
        # Sized before any peer maps it (sparse: costs nothing), so no
        # mapping ever reaches past the end of the file.
        os.ftruncate(fd, stride * (SLOTS + 1) + published)
        if reserved:
            for slot in range(SLOTS):
                os.posix_fallocate(fd, stride * (slot + 1), reserved)
        if published:
            os.posix_fallocate(fd, stride * (SLOTS + 1), published)
    except OSError:
        os.close(fd)
        raise
    return fd


def _agree(group: ProcessGroup, error: str | None, step: str, directory: str) -> None:
    """Every rank's outcome of a setup step, raised alike on every rank if
    any failed."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = {rank: failure for rank, failure in enumerate(errors) if failure is not None}
    if failed:
        reasons = "; ".join(f"rank {rank}: {failure}" for rank, failure in failed.items())
        raise SharedMemoryUnavailable(f"cannot {step} the files in {directory} ({reasons})", warn=True)


def _unlink_quietly(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _close_all(fds: list[int], mappings: dict | None = None, pages: Sequence[mmap.mmap] = ()) -> None:
    for page in pages:
        page.close()  # no view outlives _address_of
    while mappings:
        _, (region, view) = mappings.popitem()
        del view  # the mapping's own tensor: it holds the buffer open
        try:
            region.close()
        except BufferError:
            pass  # another tensor still views it: unmapped when that one goes
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
