"""Owns: the checksums of checkpoint files — a manifest record of a file
(its size and xxh3_64 where the optional ``xxhash`` is installed, else
CRC-32), read back (``file_record``) or taken while DCP writes the file
(``ChecksummingFileSystem``), and the digest of a file on disk.

Knows nothing of: manifests, directories, models, what DCP writes inside
its files.

[Note: checksum algorithms]
A record names its algorithm by its key: ``{"bytes", "xxh3_64"}`` (hex
string) or ``{"bytes", "crc32"}`` (an int; older manifests, still
verified). xxh3_64 when ``xxhash`` imports (verification must add little to
a load), else CRC-32; an xxh3_64 record without ``xxhash`` is an error,
never a skipped check. Files are hashed through an mmap window by window,
each window's pages dropped once hashed, so verifying adds at most one
window to RSS (measurements: docs/design/checkpoint.md). Pinned by
tests/checkpoint/test_checksums.py (``_xxhash = None`` forces CRC-32).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .errors import CheckpointError
from .untrusted.safe_files import open_regular

__all__ = ["ChecksummingFileSystem", "file_record", "digest_file", "can_compute"]

try:  # optional: `pip install xxhash` (the "fast" extra)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None  # type: ignore[assignment]  # absent optional module: checked for None before use

_WINDOW = 1 << 23  # 8 MiB, a multiple of every page size


def can_compute(algorithm: str) -> bool:
    """Whether this process can compute ``algorithm``'s checksums."""
    return algorithm == "crc32" or (algorithm == "xxh3_64" and _xxhash is not None)


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
            raise CheckpointError(f"composable_shard.checkpoint.checksums: no checksum algorithm {algorithm!r} here")

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int | str:
        return self._xxh.hexdigest() if self._xxh is not None else self._crc


def digest_file(path: Path, algorithm: str) -> int | str:
    """``path``'s checksum, read through an mmap window by window (see
    [Note: checksum algorithms])."""
    digest = _Digest(algorithm)
    stream, size = open_regular(path, f"checksum of '{path}'")  # never blocks on a FIFO or device
    with stream:
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
    return {"bytes": path.stat().st_size, algorithm: digest_file(path, algorithm)}

