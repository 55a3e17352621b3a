"""Owns: opening the files a checkpoint names — a name from ``.metadata`` or
the manifest resolves inside the checkpoint directory (no absolute path, no
``..``, no symbolic link leading out unless ``allow_links_outside``), and is
opened as a regular file (never blocking on a FIFO or a device) with its
real size, so every read can be bounded by it.

Knows nothing of: DCP, pickles, manifests, models (callers name the item).

[Note: names stay inside the checkpoint]
A checkpoint directory is input from outside. Every file it names is
resolved here: the name must be relative and free of ``..``; its real path
(symbolic links followed) must lie inside the directory's real path, so a
Hugging Face style link to a blob in the same directory keeps working while
a link to ``/etc`` or another checkpoint is a ``CheckpointError`` — unless
the caller passes ``allow_links_outside=True`` (links placed by someone the
user trusts, e.g. a shared cache). The file is opened with ``O_NONBLOCK``
(opening a FIFO never blocks) and ``O_NOFOLLOW`` on the resolved path, and
``fstat`` must say it is a regular file. Pinned by
tests/checkpoint/test_hostile.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ..errors import CheckpointError

__all__ = ["resolve_inside", "open_regular", "regular_file_stat", "check_name", "read_bounded"]


def check_name(name: object, where: str) -> str:
    """``name`` if it is a relative path with no ``..`` (a path a checkpoint
    may name), else ``CheckpointError`` naming ``where``."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}: the file name {name!r:.200} is not a file name. The checkpoint is damaged; load another one.")
    parts = PurePosixPath(name).parts
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ".." in name.split("\\"):
        raise CheckpointError(
            f"{where}: the file name {name!r:.200} leads outside the checkpoint directory (absolute or '..'); refused, "
            "nothing outside the directory was read. The checkpoint is damaged or hostile; load another one."
        )
    return name


def resolve_inside(directory: str | os.PathLike[str], name: str, where: str, *, allow_links_outside: bool = False) -> Path:
    """The real path of ``name`` in ``directory`` (see [Note: names stay
    inside the checkpoint])."""
    check_name(name, where)
    root = Path(os.path.realpath(directory))
    resolved = Path(os.path.realpath(os.path.join(root, name)))
    if not allow_links_outside and resolved != root and root not in resolved.parents:
        raise CheckpointError(
            f"{where}: '{name}' is a symbolic link to '{resolved}', outside the checkpoint directory '{root}'; refused, "
            "nothing was read from it. Copy the file into the directory, or pass allow_links_outside=True if you trust "
            "whoever placed the link."
        )
    return resolved


def open_regular(path: str | os.PathLike[str], where: str) -> tuple[BinaryIO, int]:
    """``path`` opened for reading (unbuffered) and its size; a
    ``CheckpointError`` naming ``where`` if it is missing or not a regular
    file (a FIFO, a device, a directory). Never blocks."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        raise CheckpointError(
            f"{where}: cannot open '{path}' ({exc.strerror or exc}). The checkpoint is incomplete or damaged; load another one."
        ) from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                f"{where}: '{path}' is not a regular file (a FIFO, device or directory); refused without reading it. "
                "The checkpoint is damaged or hostile; load another one."
            )
        stream = os.fdopen(descriptor, "rb", buffering=0)
    except BaseException:
        os.close(descriptor)
        raise
    return stream, info.st_size


def regular_file_stat(path: str | os.PathLike[str], where: str) -> os.stat_result:
    """``lstat`` of a resolved ``path`` (``resolve_inside``), which must be a
    regular file (a link swapped in since it was resolved is refused too);
    a ``CheckpointError`` naming ``where`` otherwise. Opens nothing, so never
    blocks; for checks that need only the size (metadata_checks.py) — a read
    still goes through ``open_regular``."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise CheckpointError(
            f"{where}: cannot open '{path}' ({exc.strerror or exc}). The checkpoint is incomplete or damaged; load another one."
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            f"{where}: '{path}' is not a regular file (a FIFO, device or directory); refused without reading it. "
            "The checkpoint is damaged or hostile; load another one."
        )
    return info


def read_bounded(path: str | os.PathLike[str], where: str, limit: int) -> bytes:
    """The whole of a small regular file (at most ``limit`` bytes, else
    ``CheckpointError``)."""
    stream, size = open_regular(path, where)
    with stream:
        if size > limit:
            raise CheckpointError(f"{where}: '{path}' has {size} bytes, more than the {limit} such a file may have; refused.")
        data = stream.read(size + 1)
    return data[:size]
