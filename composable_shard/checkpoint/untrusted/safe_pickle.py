"""Owns: reading the pickles inside checkpoint files as data — ``.metadata``
through an unpickler that admits only what DCP metadata is made of, every
other pickled item (extra states, hyperparameters, ``extra_state``) with
``torch.load(weights_only=True)`` — refusing anything else with
``UnsafeCheckpointError`` naming the file, the item and the global.

Knows nothing of: models, optimizers, manifests, where items sit in files
(reader.py hands it bytes).

[Note: checkpoints are data]
A pickle can run code while it is read, so every reader of ours
(``load_checkpoint``, ``DirectFileSystemReader``, the converters) reads
checkpoint pickles only here. ``.metadata`` admits the (module, name) pairs
of ``METADATA_GLOBALS`` and torch's dtypes, layouts and memory formats; a
global outside them raises before it is looked up, so nothing it names is
imported. Users admit their own types as PyTorch has them do
(``torch.serialization.add_safe_globals``, or ``safe_globals=`` per call);
``trusted=True`` reads unrestricted, never the default. Pinned by
tests/checkpoint/test_pickles.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointError, UnsafeCheckpointError
from .pickle_bounds import check_pickle, check_saved_pickles
from .safe_files import read_bounded

__all__ = [
    "PickleTrust",
    "METADATA_GLOBALS",
    "HOW_TO_ADMIT",
    "load_metadata",
    "read_metadata_bytes",
    "load_object",
    "admitted_globals",
    "unsafe_globals_in",
    "refusal_in",
]

logger = logging.getLogger(__name__)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

# (module, name) of every global a DCP ``.metadata`` pickle names
# (FileSystemWriter with the default planner; older torch releases'
# checkpoints included), besides torch's dtypes, layouts and memory formats.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        (_DCP_FILESYSTEM, "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # rebuilds torch.strided etc. from its name
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        # StorageMeta.checkpoint_id: the path the checkpoint was saved to
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13+
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "PureWindowsPath"),
    }
)

HOW_TO_ADMIT = (
    "If this is a type of yours, admit it with torch.serialization.add_safe_globals([...]) or safe_globals=[...]; "
    "if you wrote this checkpoint yourself and trust it, load it with trusted=True"
)


@dataclasses.dataclass(frozen=True)
class PickleTrust:
    """How far a load trusts the pickles in a checkpoint."""

    # Unrestricted pickle (code in the files runs): only for checkpoints the user trusts.
    trusted: bool = False
    # Classes and functions the user admits besides the defaults (as torch.serialization.add_safe_globals takes them).
    safe_globals: tuple[Any, ...] = ()
    # Whether files may be symbolic links leading out of the checkpoint directory (safe_files.py).
    allow_links_outside: bool = False

    @classmethod
    def of(cls, trusted: bool, safe_globals: Sequence[Any] | None, allow_links_outside: bool = False) -> "PickleTrust":
        if not isinstance(trusted, bool):
            raise TypeError(f"composable_shard checkpoint loading: trusted must be True or False, got {trusted!r}.")
        admitted = tuple(safe_globals or ())
        bad = [entry for entry in admitted if _name_of(entry) is None]
        if bad:
            raise TypeError(
                f"composable_shard checkpoint loading: safe_globals takes classes and functions (or (object, "
                f"'module.name') pairs, as torch.serialization.add_safe_globals does), got {bad!r}. Pass the type itself."
            )
        return cls(trusted, admitted, bool(allow_links_outside))


def _name_of(admitted: Any) -> tuple[str, str] | None:
    """(module, name) of an entry of a safe-globals list: an object, or
    ``(object, "module.name")`` as ``add_safe_globals`` takes it."""
    if isinstance(admitted, tuple) and len(admitted) == 2 and isinstance(admitted[1], str):
        module, _, name = admitted[1].rpartition(".")
        return (module, name) if module else None
    if not callable(admitted):
        return None
    owner, qualname = getattr(admitted, "__module__", None), getattr(admitted, "__qualname__", None)
    return (owner, qualname) if isinstance(owner, str) and isinstance(qualname, str) else None


def _user_globals(trust: PickleTrust) -> dict[tuple[str, str], Any]:
    """What the user admitted: torch's safe globals and the argument."""
    registered = list(torch.serialization.get_safe_globals())
    admitted: dict[tuple[str, str], Any] = {}
    for entry in [*registered, *trust.safe_globals]:
        key = _name_of(entry)
        if key is not None:
            admitted[key] = entry[0] if isinstance(entry, tuple) else entry
    return admitted


def _is_torch_constant(module: str, name: str) -> bool:
    """A dtype, layout or memory format, which pickle as ``torch.<name>``."""
    if module != "torch" or name.startswith("_"):
        return False
    # vars(), not getattr: torch's module __getattr__ imports submodules on demand.
    return isinstance(vars(torch).get(name), (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; refuses every global but the admitted ones."""

    def __init__(self, stream: io.BufferedIOBase, path: Path, user: dict[tuple[str, str], Any]) -> None:
        super().__init__(stream)
        self._path = path
        self._user = user

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._user:
            return self._user[(module, name)]
        if (module, name) in METADATA_GLOBALS or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"'{self._path}' (the checkpoint's metadata) wants the pickle global {module}.{name}, which DCP metadata "
            f"is not made of; refused before it was looked up, nothing was loaded. {HOW_TO_ADMIT}."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"'{self._path}' (the checkpoint's metadata) holds a persistent reference (a {type(pid).__name__}), which DCP "
            f"metadata never does; refused, nothing was loaded. {HOW_TO_ADMIT}."
        )


def read_metadata_bytes(path: str | Path) -> bytes:
    """The bytes of a ``.metadata`` file (a regular file, size-bounded)."""
    return read_bounded(path, f"'{path}' (the checkpoint's metadata)", _METADATA_MAX_BYTES)


def load_metadata(path: str | Path, trust: PickleTrust, data: bytes | None = None) -> Metadata:
    """The ``Metadata`` pickled in ``path`` (a DCP ``.metadata`` file; its
    bytes ``data`` where the caller read them with ``read_metadata_bytes``),
    read as data (see [Note: checkpoints are data]). Raises
    ``UnsafeCheckpointError`` for a global it does not admit and
    ``CheckpointError`` for a file that is not DCP metadata."""
    path = Path(path)
    if data is None:
        data = read_metadata_bytes(path)
    if trust.trusted:
        metadata = pickle.loads(data)  # noqa: S301 - the user trusts this checkpoint
    else:
        try:
            check_pickle(data, f"'{path}' (the checkpoint's metadata)")
            metadata = _MetadataUnpickler(io.BytesIO(data), path, _user_globals(trust)).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged pickle: say which file
            raise CheckpointError(
                f"'{path}' is not readable DCP metadata ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). "
                "The checkpoint is damaged or incomplete; load another one."
            ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"'{path}' holds a {type(metadata).__name__}, not DCP metadata. Load a torch.distributed.checkpoint "
            "directory."
        )
    return metadata


@contextlib.contextmanager
def admitted_globals(trust: PickleTrust) -> Iterator[None]:
    """``trust.safe_globals`` added to torch's weights-only list for the
    duration."""
    if not trust.safe_globals:
        yield
        return
    with torch.serialization.safe_globals(list(trust.safe_globals)):
        yield


def unsafe_globals_in(item: Any) -> list[str]:
    """The globals of a ``torch.save`` file (bytes or a seekable file)
    that ``torch.load(weights_only=True)`` would refuse, found without
    unpickling; [] where it cannot tell (torch.load then decides)."""
    try:
        source = io.BytesIO(item) if isinstance(item, (bytes, bytearray)) else item
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - not a zip archive etc.: torch.load decides
        return []


_METADATA_MAX_BYTES = 1 << 31

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def _wanted(data: bytes, exc: BaseException) -> str:
    """The globals a refused ``torch.save`` item wanted, for the message."""
    names = unsafe_globals_in(data)
    if names:
        return ", ".join(names)
    found = _GLOBAL_IN_MESSAGE.findall(str(exc))
    if found:
        return ", ".join(dict.fromkeys(found))
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def load_object(data: bytes, trust: PickleTrust, *, file: str, item: str) -> Any:
    """The object ``torch.save`` wrote as ``data`` (one bytes item, ``item``
    of ``file``), read with ``torch.load(weights_only=True)`` unless
    trusted. Raises ``UnsafeCheckpointError`` naming the global it wanted."""
    if trust.trusted:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    check_saved_pickles(data, f"'{file}': the item '{item}'")
    with admitted_globals(trust):
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            wanted = _wanted(data, exc)
            raise UnsafeCheckpointError(
                f"'{file}': the item '{item}' wants {wanted}, which plain data (numbers, strings, containers, tensors) "
                f"does not need; refused before it ran, nothing was loaded. {HOW_TO_ADMIT}."
            ) from None
        except Exception as exc:  # noqa: BLE001 - a damaged item: say which
            raise CheckpointError(
                f"'{file}': the item '{item}' is unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). "
                "The checkpoint is damaged; load another one."
            ) from None


def refusal_in(exc: BaseException) -> UnsafeCheckpointError | None:
    """The ``UnsafeCheckpointError`` behind a failed ``dcp.load`` (DCP
    wraps every rank's exception; the lowest rank that refused), or None if
    it was not a refusal."""
    if isinstance(exc, UnsafeCheckpointError):
        return exc
    if isinstance(exc, CheckpointException):
        for _, failure in sorted(exc.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            found = refusal_in(cause) if isinstance(cause, BaseException) else None
            if found is not None:
                return found
    chained = exc.__cause__ or exc.__context__
    return refusal_in(chained) if isinstance(chained, BaseException) and chained is not exc else None
