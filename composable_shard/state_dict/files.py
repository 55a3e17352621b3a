"""Owns: the files of a checkpoint directory — the manifest of every file's
size and checksum (xxh3_64 where the optional ``xxhash`` module is
installed, else CRC-32; see [Note: checksum algorithms]), checking a directory against it, and switching a complete
new directory into place atomically. See [Note: checkpoint safety] in
checkpoint.py.

Knows nothing of: models, optimizers, state dicts, what DCP writes inside
its files.

Public names: ``CheckpointError``, ``MANIFEST_NAME``, ``verify_checkpoint``,
``manifest_hints``, ``write_manifest``, ``file_record``,
``switch_into_place``, ``SwitchedButNotDurable``, ``clear_staging``, ``agree``, ``rank0_step``, ``current_rank``,
``current_world_size``, ``ChecksummingFileSystem``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import mmap
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .. import comm

__all__ = [
    "CheckpointError",
    "MANIFEST_NAME",
    "verify_checkpoint",
    "manifest_hints",
    "write_manifest",
    "file_record",
    "switch_into_place",
    "SwitchedButNotDurable",
    "clear_staging",
    "agree",
    "rank0_step",
    "current_rank",
    "current_world_size",
    "ChecksummingFileSystem",
]

logger = logging.getLogger(__name__)

try:  # optional: `pip install xxhash` (the "fast" extra)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

# [Note: checksum algorithms]
# Each manifest record names its algorithm by its key: {"bytes", "xxh3_64"}
# (a 16-digit hex string) or {"bytes", "crc32"} (an int; what every manifest
# before this held, still verified). New records use xxh3_64 when ``xxhash``
# imports (several times faster than zlib.crc32: verification must add little
# to a load), else crc32. Files are hashed through an mmap in windows whose
# pages are dropped from this process as soon as hashed, so verifying copies
# nothing into Python buffers and adds at most one window to RSS. A record in
# xxh3_64 where ``xxhash`` is missing is an error, never a skipped check.
# Tests force the crc32 path by setting ``_xxhash = None``.
# Measured on the 2-core CI machine (a 1.6 GB file in the page cache, two
# processes hashing one file each, as two ranks do): the mmap hashes at
# 8-9 GB/s per process whatever the window from 4 to 64 MiB, while
# ``readinto`` into one reused buffer (1-16 MiB) reached 0.7-2.3 GB/s (it
# copies every byte once more); so mmap, and the smallest window that costs
# nothing, which is all verification adds to RSS.
_WINDOW = 1 << 23  # 8 MiB, a multiple of every page size

MANIFEST_NAME = "composable_shard.manifest.json"
_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, damaged or incomplete, or writing
    one failed. Raised before the model or optimizer is changed."""


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(error: str | None) -> None:
    """Every rank raises if any rank reports an error (first one wins)."""
    errors = comm.all_gather_object(error) if dist.is_initialized() else [error]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def rank0_step(what: str, step: Callable[[], None]) -> None:
    """Run ``step()`` on rank 0 and make every rank see how it went."""
    error = None
    if current_rank() == 0:
        try:
            step()
        except SwitchedButNotDurable as exc:  # not what ``what`` says (the switch happened): say that
            error = f"{what.split(':', 1)[0]}: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{what}: {type(exc).__name__}: {exc}"
    if dist.is_initialized():
        error = comm.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)


# ------------------------------------------------------------------ files
def _algorithm() -> str:
    """The algorithm new records use."""
    return "xxh3_64" if _xxhash is not None else "crc32"


class _Digest:
    """A streaming checksum in one of the manifest's algorithms."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._xxh = _xxhash.xxh3_64() if algorithm == "xxh3_64" and _xxhash is not None else None
        if algorithm not in ("crc32", "xxh3_64") or (algorithm == "xxh3_64" and self._xxh is None):
            raise CheckpointError(f"composable_shard.state_dict.files: no checksum algorithm {algorithm!r} here")

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int | str:
        return self._xxh.hexdigest() if self._xxh is not None else self._crc


def _digest_file(path: Path, algorithm: str) -> int | str:
    """``path``'s checksum, read through an mmap window by window (see
    [Note: checksum algorithms])."""
    digest = _Digest(algorithm)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if size == 0:  # an empty file cannot be mapped
            return digest.value()
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            drop = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mapped, "madvise") else None
            with memoryview(mapped) as view:
                for start in range(0, size, _WINDOW):
                    length = min(_WINDOW, size - start)
                    with view[start : start + length] as window:
                        digest.update(window)
                    if drop is not None:  # the page cache keeps them; this process's RSS does not
                        mapped.madvise(drop, start, length)
    return digest.value()


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the size and checksum of every file
    it writes, computed on the bytes as they are written (so saving need not
    read its files back). A file written other than front to back (a seek)
    gets no record; the caller then reads it back."""

    def __init__(self) -> None:
        super().__init__()
        # File name -> {"bytes", <algorithm>}, for files written sequentially.
        self.records: dict[str, dict[str, Any]] = {}

    @classmethod
    def attach(cls, writer: FileSystemWriter) -> "ChecksummingFileSystem | None":
        """Make ``writer`` write through a new instance (None where this
        torch's writer keeps its file system elsewhere)."""
        if not isinstance(getattr(writer, "fs", None), FileSystem):
            return None
        checksums = cls()
        writer.fs = checksums
        return checksums

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            writer = _ChecksummingStream(stream)
            yield writer
        if writer.is_sequential:
            self.records[Path(path).name] = {"bytes": writer.count, writer.digest.algorithm: writer.digest.value()}


class _ChecksummingStream:
    """A writable file that checksums what passes through ``write``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.digest = _Digest(_algorithm())
        self.count = 0
        self.is_sequential = True

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        try:
            view = memoryview(data).cast("B")
            written_bytes = len(view) if written is None else written
            self.digest.update(view[:written_bytes])
            self.count += written_bytes
        except (TypeError, ValueError):  # not a contiguous buffer: no record, read back instead
            self.is_sequential = False
        return written

    def seek(self, *args: Any) -> int:
        self.is_sequential = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def file_record(path: Path) -> dict[str, Any]:
    """``path``'s manifest record, read back (see [Note: checksum algorithms])."""
    algorithm = _algorithm()
    return {"bytes": path.stat().st_size, algorithm: _digest_file(path, algorithm)}


# errnos of a file system that cannot fsync a directory at all (nothing to
# make durable there, so nothing lost by going on).
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS}


def _fsync_dir(path: Path) -> None:
    """Make ``path``'s entries durable. Raises ``OSError`` when the sync
    fails; a file system that cannot sync directories is logged (DEBUG)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _FSYNC_UNSUPPORTED:
            raise
        logger.debug("composable_shard: fsync of directory '%s' is not supported here (%s)", path, exc)
    finally:
        os.close(fd)


def write_manifest(
    directory: Path,
    files: dict[str, dict[str, Any]],
    model_keys: list[str],
    scalar_params: list[str],
    aliases: dict[str, str] | None = None,
    optim_param_groups: list[list[str]] | None = None,
) -> None:
    manifest = {
        "format": _FORMAT,
        "world_size": current_world_size(),
        "files": dict(sorted(files.items())),
        # For the converters: the model's keys in nn.Module.state_dict order,
        # its 0-dim parameters stored with shape (1,) (earlier versions, and
        # the ShardedTensor fallback; see stored_shape), and tied aliases ->
        # the canonical name of the same parameter (written once).
        "model_keys": model_keys,
        "scalar_params": scalar_params,
        "aliases": dict(aliases or {}),
    }
    if optim_param_groups is not None:
        # The optimizer's parameter names per group, so loading can check them
        # before reading anything (see [Note: checkpoint safety]).
        manifest["optim_param_groups"] = optim_param_groups
    target = directory / MANIFEST_NAME
    with open(target, "w") as stream:
        json.dump(manifest, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    _fsync_dir(directory)


def _libc_renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (None where this platform has none)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    return getattr(ctypes.CDLL(libc_name, use_errno=True), "renameat2", None)


def _exchange(first: Path, second: Path) -> str | None:
    """Atomically swap two directories (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); None when done, else why not."""
    renameat2 = _libc_renameat2()
    if renameat2 is None:
        return "this platform's C library has no renameat2"
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return None
    code = ctypes.get_errno()
    return f"renameat2(RENAME_EXCHANGE) failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})"


class SwitchedButNotDurable(CheckpointError):
    """The new checkpoint is in place, but syncing its parent directory
    failed, so a crash may still bring the previous one back."""


def switch_into_place(staging: Path, target: Path) -> None:
    """Make the complete ``staging`` directory be ``target``; the old
    ``target`` is never left half-written. See [Note: checkpoint safety].

    Raises before the switch (``target`` unchanged) or
    ``SwitchedButNotDurable`` after it; deleting the old checkpoint once
    the new one is in place may fail (a file held open on NFS): that is a
    warning, and the next save clears it away (``clear_staging``)."""
    if not target.exists():
        os.rename(staging, target)
        _sync_switch(target)
        return
    why_not = _exchange(staging, target)
    if why_not is None:
        _sync_switch(target)
        _remove_old(staging, target)  # staging now holds the old checkpoint
        return
    previous = target.with_name(target.name + ".previous")
    logger.warning(
        "composable_shard: switching '%s' into place through two renames via '%s' (%s): a crash between them leaves "
        "the previous checkpoint at '%s'",
        target, previous, why_not, previous,
    )
    shutil.rmtree(previous, ignore_errors=True)
    os.rename(target, previous)
    os.rename(staging, target)
    _sync_switch(target)
    _remove_old(previous, target)


def _sync_switch(target: Path) -> None:
    """fsync ``target``'s parent right after the switch, so the switch is
    durable before anything else happens (not resting on journal order)."""
    try:
        _fsync_dir(target.parent)
    except OSError as exc:
        raise SwitchedButNotDurable(
            f"the new checkpoint is in place at '{target}', but syncing its directory '{target.parent}' failed ({exc}): "
            "after a crash the previous checkpoint may be back. Check the file system and save again."
        ) from exc


def _remove_old(old: Path, target: Path) -> None:
    """Delete the previous checkpoint; failing is a warning (the new one is
    in place)."""
    try:
        shutil.rmtree(old)
    except OSError as exc:
        message = (
            f"composable_shard: the new checkpoint is in place at '{target}', but deleting the previous one at '{old}' "
            f"failed ({exc}); the next save to '{target}' moves it aside and retries. Delete it yourself to free the space."
        )
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def clear_staging(staging: Path) -> None:
    """Make ``staging`` a new, empty directory: what an interrupted save or
    an undeletable previous checkpoint left there is deleted, or, where that
    fails, moved aside to ``<staging>.stale-<n>`` (deleted by a later save
    where possible)."""
    for stale in staging.parent.glob(f"{staging.name}.stale-*"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    if staging.exists():
        aside = next(
            staging.with_name(f"{staging.name}.stale-{n}")
            for n in range(1, 1 << 30)
            if not staging.with_name(f"{staging.name}.stale-{n}").exists()
        )
        logger.warning("composable_shard: cannot delete '%s'; moving it aside to '%s'", staging, aside)
        os.rename(staging, aside)
    staging.mkdir(parents=True)


def verify_checkpoint(path: str | os.PathLike[str], *, ranks_share_work: bool = True) -> bool:
    """Check a checkpoint directory against its manifest (every file's size
    and checksum, xxh3_64 or CRC-32) and raise ``CheckpointError`` naming the first bad files.
    Collective when a process group is initialised and ``ranks_share_work``
    (the ranks split the files by size). A directory without a
    manifest (written by plain ``dcp.save``) is checked for its metadata
    file only. Returns whether a manifest verified every file."""
    directory = Path(path)
    what = f"load_checkpoint({directory})"
    _check_exists(directory, what)
    manifest_path = directory / MANIFEST_NAME
    error = None
    if not manifest_path.exists():
        if not (directory / ".metadata").exists():
            error = (
                f"{what}: no '.metadata' file: this is not a complete torch.distributed.checkpoint directory (an "
                "interrupted save?). Load another checkpoint."
            )
        logger.info("%s: no manifest; file checksums not verified", what)
        _raise_if(error)
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{what}: the manifest {MANIFEST_NAME} is unreadable ({exc}). The checkpoint is damaged; load another one."
        ) from exc
    share = ranks_share_work and dist.is_initialized()
    unverifiable = _unverifiable(files, what)
    if share:
        agree(unverifiable)  # every rank raises together
    _raise_if(unverifiable)
    rank, world = (current_rank(), current_world_size()) if share else (0, 1)
    mine = [(name, files[name]) for name in _share_of(files, rank, world)]
    bad = [_file_problem(directory, name, record) for name, record in mine]
    bad_files = [problem for problem in bad if problem is not None]
    if share:
        bad_files = [problem for rank_bad in comm.all_gather_object(bad_files) for problem in rank_bad]
    if bad_files:
        shown = "; ".join(bad_files[:3]) + (f" (and {len(bad_files) - 3} more)" if len(bad_files) > 3 else "")
        raise CheckpointError(
            f"{what}: the checkpoint is damaged: {shown}. Nothing was loaded; load an older checkpoint (or restore "
            "the files)."
        )
    return True


def _unverifiable(files: dict[str, Any], what: str) -> str | None:
    """Why this process cannot check the manifest's checksums (None if it can)."""
    for name, record in files.items():
        if not isinstance(record, dict) or "bytes" not in record:
            return f"{what}: the manifest's record of '{name}' is malformed. The checkpoint is damaged; load another one."
        if "xxh3_64" in record:
            if _xxhash is None:
                return (
                    f"{what}: file '{name}' was checksummed with xxh3_64 but the 'xxhash' module is not installed, "
                    "so the checkpoint cannot be verified. Run `pip install xxhash` (or install composable_shard[fast]) "
                    "and load again. Nothing was loaded."
                )
        elif "crc32" not in record:
            return (
                f"{what}: the manifest's record of '{name}' names no known checksum (keys {sorted(record)}; known: "
                "xxh3_64, crc32). Upgrade composable_shard or load another checkpoint."
            )
    return None


def _share_of(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files ``rank`` checks: largest first, each to the rank with the
    fewest bytes so far (the same answer on every rank), so every rank reads
    about the same amount (one data file each when every rank wrote one)."""
    load = [0] * world
    share: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(files, key=lambda name: (-int(files[name].get("bytes", 0)), name)):
        least = min(range(world), key=lambda r: (load[r], r))
        load[least] += int(files[name].get("bytes", 0))
        share[least].append(name)
    return share[rank]


def _raise_if(error: str | None) -> None:
    if error is not None:
        raise CheckpointError(error)


def _check_exists(directory: Path, what: str) -> None:
    if directory.is_dir():
        return
    previous = directory.with_name(directory.name + ".previous")
    hint = (
        f" An interrupted save left the last complete checkpoint at '{previous}': rename it to '{directory}'."
        if previous.is_dir()
        else " Check the path."
    )
    raise CheckpointError(f"{what}: no checkpoint directory at '{directory}'.{hint}")


def _file_problem(directory: Path, name: str, record: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"file '{name}' is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"file '{name}' has {size} bytes, the manifest records {record['bytes']} (truncated or overwritten)"
    algorithm = "xxh3_64" if "xxh3_64" in record else "crc32"
    if _digest_file(path, algorithm) != record[algorithm]:
        return f"file '{name}' does not match its checksum (corrupted)"
    return None


def manifest_hints(directory: Path) -> dict[str, Any]:
    """The manifest's contents ({} for a directory without one)."""
    manifest_path = directory / MANIFEST_NAME
    return json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
