"""Owns: switching a complete new checkpoint directory into place
atomically, and clearing the staging directory a save writes into. See
[Note: checkpoint safety] in save_load.py.

Knows nothing of: manifests, checksums, models, DCP.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

from .errors import SwitchedButNotDurable

__all__ = ["switch_into_place", "clear_staging", "fsync_dir"]

logger = logging.getLogger(__name__)

# errnos of a file system that cannot fsync a directory at all (nothing to
# make durable there, so nothing lost by going on).
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS}


def fsync_dir(path: Path) -> None:
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
        fsync_dir(target.parent)
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
