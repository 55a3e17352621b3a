"""Owns: checkpoint directories — ``save_checkpoint`` / ``load_checkpoint``
of a model (and optimizer) through ``torch.distributed.checkpoint``, written
so that a failed save never damages the previous checkpoint and a damaged,
incomplete or foreign checkpoint is refused before anything is changed; and
the conversion between a checkpoint directory and one ``torch.save`` file.

Knows nothing of: flat parameters, hooks (it goes through the state-dict
functions).

Public names: ``save_checkpoint``, ``load_checkpoint``, ``CheckpointError``,
``MANIFEST_NAME``, ``verify_checkpoint``, ``dcp_to_torch_save``,
``torch_save_to_dcp``.

[Note: checkpoint safety]
A checkpoint directory holds the DCP files (``.metadata`` and one
``__<rank>_<n>.distcp`` per writing rank) of the nested state dict
``{"model": ..., "optim": ..., "extra": ...}`` plus our manifest
``composable_shard.manifest.json`` (every file's size and CRC-32).

Saving writes into the sibling ``<dir>.partial`` (emptied first); each rank
checksums the files it wrote; rank 0 writes the manifest last, then switches
the new directory into place: an atomic exchange of the two directories
(``renameat2(RENAME_EXCHANGE)`` on Linux) followed by deleting the old one,
or, where that is unavailable, two renames through ``<dir>.previous``. So at
every instant ``<dir>`` is either the complete old checkpoint or the complete
new one (in the two-rename fallback a crash between the renames leaves the
old one complete at ``<dir>.previous``, and ``load_checkpoint`` says so).
Every step's outcome is broadcast by rank 0, so all ranks raise together.

Loading first checks the manifest (sizes and CRCs; the ranks split the
files), then reads the DCP metadata and compares its keys and shapes with the
model and optimizer, then reads the data into new buffers (never into the
model), and only then copies it in through ``set_model_state_dict`` /
``set_optimizer_state_dict``, which validate once more before copying.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .. import comm
from .optim import (
    check_optimizer_state_dict,
    get_optimizer_state_dict,
    is_param_shaped,
    optimizer_params,
    set_optimizer_state_dict,
)
from .model import (
    ModelEntries,
    StateDictError,
    StateDictOptions,
    empty_model_state_dict,
    get_model_state_dict,
    key_mismatch_message,
    model_entries,
    prepare_units,
    set_model_state_dict,
    sharding_of,
    value_mismatch_message,
)
from .range_tensor import HAS_DCP_TENSOR_PROTOCOL
from .shards import sharded_tensor_of_range, stored_shape

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "MANIFEST_NAME",
    "verify_checkpoint",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "composable_shard.manifest.json"
_FORMAT = 1
_MODEL, _OPTIM, _EXTRA = "model", "optim", "extra"
# Only where torch predates DCP's tensor protocol do our state dicts hold
# PyTorch's deprecated ShardedTensor, whose every access in DCP warns. See
# [Note: DCP tensor protocol].
_SHARDED_TENSOR_WARNING = "Please use DTensor instead and we are deprecating ShardedTensor"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, damaged or incomplete, or writing
    one failed. Raised before the model or optimizer is changed."""


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    if HAS_DCP_TENSOR_PROTOCOL:  # nothing deprecated is used: let every warning through
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SHARDED_TENSOR_WARNING, category=FutureWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _agree(error: str | None) -> None:
    """Every rank raises if any rank reports an error (first one wins)."""
    errors = comm.all_gather_object(error) if dist.is_initialized() else [error]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _rank0_step(what: str, step: Callable[[], None]) -> None:
    """Run ``step()`` on rank 0 and make every rank see how it went."""
    error = None
    if _rank() == 0:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{what}: {type(exc).__name__}: {exc}"
    if dist.is_initialized():
        error = comm.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)


# ------------------------------------------------------------------ files
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _file_record(path: Path) -> dict[str, int]:
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_manifest(
    directory: Path, files: dict[str, dict[str, int]], model_keys: list[str], scalar_params: list[str]
) -> None:
    manifest = {
        "format": _FORMAT,
        "world_size": _world_size(),
        "files": dict(sorted(files.items())),
        # For the converter: the model's keys in nn.Module.state_dict order,
        # and its 0-dim parameters, stored with shape (1,) (see stored_shape).
        "model_keys": model_keys,
        "scalar_params": scalar_params,
    }
    target = directory / MANIFEST_NAME
    with open(target, "w") as stream:
        json.dump(manifest, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    _fsync_dir(directory)


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two directories (Linux ``renameat2``); False where the
    platform cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange)
    return result == 0


def _switch_into_place(staging: Path, target: Path) -> None:
    """Make the complete ``staging`` directory be ``target``; the old
    ``target`` is never left half-written. See [Note: checkpoint safety]."""
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # now the old checkpoint
    else:
        previous = target.with_name(target.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
        os.rename(staging, target)
        shutil.rmtree(previous)
    _fsync_dir(target.parent)


def verify_checkpoint(path: str | os.PathLike[str], *, ranks_share_work: bool = True) -> None:
    """Check a checkpoint directory against its manifest (every file's size
    and CRC-32) and raise ``CheckpointError`` naming the first bad files.
    Collective when a process group is initialised and ``ranks_share_work``
    (each rank checks every world-size-th file). A directory without a
    manifest (written by plain ``dcp.save``) is checked for its metadata
    file only."""
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
        return _raise_if(error)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _raise_if(
            f"{what}: the manifest {MANIFEST_NAME} is unreadable ({exc}). The checkpoint is damaged; load another one."
        )
    share = ranks_share_work and dist.is_initialized()
    rank, world = (_rank(), _world_size()) if share else (0, 1)
    mine = [(name, record) for i, (name, record) in enumerate(sorted(files.items())) if i % world == rank]
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


def _file_problem(directory: Path, name: str, record: dict[str, int]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"file '{name}' is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"file '{name}' has {size} bytes, the manifest records {record['bytes']} (truncated or overwritten)"
    if _crc32(path) != record["crc32"]:
        return f"file '{name}' does not match its checksum (corrupted)"
    return None


# ------------------------------------------------------------------- save
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: dict[str, Any] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``, and picklable ``extra_state``) as a
    sharded checkpoint directory at ``path``, replacing any checkpoint there
    only once the new one is complete. See [Note: checkpoint safety].

    Collective: every rank calls it with the same ``path`` (on a file system
    all ranks share). Each rank writes only what it holds.
    """
    target = Path(path)
    what = f"save_checkpoint({target})"
    staging = target.with_name(target.name + ".partial")
    entries = model_entries(model, prepare_units(model, "save_checkpoint"))
    scalar_params = [key for entry in entries.sharded if len(entry.info.shape) == 0 for key in entry.keys]
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[_OPTIM] = get_optimizer_state_dict(model, optimizer)
    if extra_state:
        state[_EXTRA] = dict(extra_state)

    def prepare() -> None:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        staging.mkdir(parents=True)

    _rank0_step(f"{what}: cannot create the staging directory '{staging}'", prepare)
    error = None
    try:
        with _quiet_sharded_tensor():
            dcp.save(state, storage_writer=FileSystemWriter(staging))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank; say what is left
        error = (
            f"{what}: writing the checkpoint failed ({_describe(exc)}). The checkpoint at '{target}' (if any) is "
            "unchanged."
        )
    _agree(error)
    own: dict[str, dict[str, int]] = {}
    try:
        own = {p.name: _file_record(p) for p in staging.glob(f"__{_rank()}_*.distcp")}
    except OSError as exc:
        error = f"{what}: cannot read back the files this rank wrote ({exc}). '{target}' is unchanged."
    records = comm.all_gather_object(own) if dist.is_initialized() else [own]
    _agree(error)

    def finish() -> None:
        files = {name: record for rank_records in records for name, record in rank_records.items()}
        files[".metadata"] = _file_record(staging / ".metadata")
        _write_manifest(staging, files, entries.key_order, scalar_params)
        _switch_into_place(staging, target)

    _rank0_step(f"{what}: cannot finish the checkpoint (the previous one at '{target}' is intact)", finish)
    logger.info("%s: saved", what)


# ------------------------------------------------------------------- load
def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint directory (from ``save_checkpoint``, any world size
    or strategy) into ``model`` (and ``optimizer``); returns the saved
    ``extra_state`` (``{}`` if none). Raises ``CheckpointError`` for a missing
    or damaged checkpoint and ``StateDictError`` for one of another model
    (missing, unexpected or differently shaped keys), in both cases before
    changing anything. With ``strict=False`` only the keys both have are
    loaded. Collective: every rank calls it."""
    directory = Path(path)
    what = f"load_checkpoint({directory})"
    verify_checkpoint(directory)
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged metadata file; say so clearly
        raise CheckpointError(
            f"{what}: cannot read the checkpoint's metadata ({type(exc).__name__}: {exc}). The checkpoint is "
            "damaged or incomplete; load another one. Nothing was loaded."
        ) from exc
    saved = _saved_paths(metadata)
    units = prepare_units(model, "load_checkpoint")
    entries = model_entries(model, units)
    destination: dict[str, Any] = {_MODEL: _model_destination(entries, saved, strict, what)}
    if optimizer is not None:
        destination[_OPTIM] = _optim_destination(entries, optimizer, saved, strict, what)
    extra = _template(saved, _EXTRA)
    if extra is not None:
        destination[_EXTRA] = extra
    try:
        with _quiet_sharded_tensor():
            dcp.load(destination, storage_reader=FileSystemReader(directory))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank
        raise CheckpointError(
            f"{what}: reading the checkpoint failed ({_describe(exc)}). The checkpoint is "
            "damaged or incomplete; load another one. The model and optimizer were not changed."
        ) from exc
    options = StateDictOptions(strict=strict)
    if optimizer is not None:  # checked before the model changes: all or nothing
        check_optimizer_state_dict(model, optimizer, destination[_OPTIM], options=options)
    set_model_state_dict(model, destination[_MODEL], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, destination[_OPTIM], options=options)
    logger.info("%s: loaded", what)
    return dict(destination.get(_EXTRA) or {})


def _describe(exc: BaseException) -> str:
    """The root cause of a DCP failure in one line (its exception lists
    every rank's traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (cause, _) = next(iter(sorted(exc.failures.items())))
        return f"on rank {rank}: {_describe(cause)}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# Flat DCP key -> (path in the nested state dict, storage metadata).
_SavedPaths = dict[str, tuple[tuple[Any, ...], Any]]


def _saved_paths(metadata: Metadata) -> _SavedPaths:
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: (tuple(mappings.get(key, (key,))), md) for key, md in metadata.state_dict_metadata.items()}


def _model_destination(entries: ModelEntries, saved: _SavedPaths, strict: bool, what: str) -> dict[str, Any]:
    """New buffers shaped like the model's sharded state dict, holding only
    the keys the checkpoint has; raise before reading if it does not fit."""
    # Key -> storage metadata (None for an object saved as a nested structure).
    stored = {
        path[1]: md if len(path) == 2 else None for path, md in saved.values() if len(path) >= 2 and path[0] == _MODEL
    }
    if not stored:
        raise StateDictError(
            f"{what}: the checkpoint holds no model state (no '{_MODEL}.*' keys). Save it with save_checkpoint, "
            "or load it with torch.distributed.checkpoint.load directly."
        )
    known = set(entries.key_order)
    missing = [key for key in entries.key_order if key not in stored]
    unexpected = [key for key in stored if key not in known]
    if strict and (missing or unexpected):
        raise StateDictError(key_mismatch_message(what, missing, unexpected))
    destination = empty_model_state_dict(entries)
    problems = []
    for key in list(destination):
        if key not in stored:
            del destination[key]
            continue
        md, value = stored[key], destination[key]
        if key in entries.extra_states:
            # Whatever structure was saved (DCP flattens nested objects).
            destination[key] = _template(saved, _MODEL, only={key})[key]  # type: ignore[index]  # key is stored
            continue
        entry = entries.sharded_by_key.get(key)
        expected = stored_shape(entry.info.shape) if entry is not None else value.shape
        if not isinstance(md, TensorStorageMetadata):
            problems.append((key, "the checkpoint holds an object, not a tensor"))
        elif entry is not None and md.size == entry.info.shape != expected:
            # A 0-dim parameter saved unsharded (torch_save_to_dcp): read it whole.
            destination[key] = torch.empty((), dtype=md.properties.dtype, device=entry.param.device)
        elif md.size != expected:
            problems.append((key, f"shape {tuple(md.size)} does not match the model's {tuple(expected)}"))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    return destination


def _optim_destination(
    entries: ModelEntries, optimizer: torch.optim.Optimizer, saved: _SavedPaths, strict: bool, what: str
) -> dict[str, Any]:
    """The optimizer part of the destination, built from the checkpoint's
    metadata (so the optimizer itself is not touched): per-element state as
    ShardedTensors over new buffers of this rank's range."""
    params = {op.fqn: op for op in optimizer_params(optimizer, entries, what)}
    template = _template(saved, _OPTIM)
    if template is None:
        raise StateDictError(f"{what}: the checkpoint holds no optimizer state. Load it without the optimizer.")
    state = template.get("state", {})
    unexpected = [fqn for fqn in state if fqn not in params]
    if unexpected and strict:
        raise StateDictError(key_mismatch_message(what, [], unexpected))
    for fqn in unexpected:
        del state[fqn]  # strict=False: state of parameters this optimizer does not hold
    problems = []
    for fqn, values in state.items():
        op = params[fqn]
        if op.entry is None:
            continue
        info = op.entry.info
        for key, value in values.items():
            if not is_param_shaped(key, value, info.shape) or value.shape == info.shape != stored_shape(info.shape):
                continue  # not per-element, or a 0-dim parameter's state saved unsharded: read it whole
            if value.shape != stored_shape(info.shape):
                why = f"shape {tuple(value.shape)} does not match the parameter's {tuple(info.shape)}"
                problems.append((f"{fqn}.{key}", why))
                continue
            local = torch.empty(info.local_numel, dtype=value.dtype, device=op.param.device)
            values[key] = sharded_tensor_of_range(local, sharding_of(op.entry))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    return template


def _template(saved: _SavedPaths, root: str, *, only: set[str] | None = None) -> Any:
    """The nested structure saved under ``root`` (only the keys ``only``
    below it, if given), as a destination: new full-size CPU tensors and None
    for objects. None if nothing was saved under it."""
    items = [
        (path[1:], md)
        for path, md in saved.values()
        if len(path) > 1 and path[0] == root and (only is None or path[1] in only)
    ]
    if not items:
        return None
    tree: dict[Any, Any] = {}
    for path, md in items:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if isinstance(md, BytesStorageMetadata):
            node[path[-1]] = None
        else:
            node[path[-1]] = torch.empty(md.size, dtype=md.properties.dtype)
    return _lists(tree)


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 (list indices in DCP paths) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {key: _lists(value) for key, value in node.items()}
    if node and all(isinstance(key, int) for key in node) and sorted(node) == list(range(len(node))):
        return [node[index] for index in range(len(node))]
    return node


# ------------------------------------------------------------- conversion
def dcp_to_torch_save(
    checkpoint_dir: str | os.PathLike[str], output_path: str | os.PathLike[str], *, everything: bool = False
) -> None:
    """Write one ``torch.save`` file from a checkpoint directory, with no
    process group: the unsharded model state dict (original names and
    shapes, loadable by the unsharded model's ``load_state_dict``), or with
    ``everything`` the whole nested state (model, optimizer, extra)."""
    directory = Path(checkpoint_dir)
    verify_checkpoint(directory, ranks_share_work=False)
    metadata = FileSystemReader(directory).read_metadata()
    saved = _saved_paths(metadata)
    roots = {path[0] for path, _ in saved.values()}
    if everything or _MODEL not in roots:
        state = {root: _template(saved, root) for root in roots}
    else:
        state = {_MODEL: _template(saved, _MODEL)}
    with _quiet_sharded_tensor(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    manifest = _manifest_hints(directory)
    _restore_scalar_shapes(state, set(manifest.get("scalar_params", [])))
    if isinstance(state.get(_MODEL), dict):
        order = {key: index for index, key in enumerate(manifest.get("model_keys", []))}
        state[_MODEL] = dict(sorted(state[_MODEL].items(), key=lambda item: order.get(item[0], len(order))))
    result = state if everything or _MODEL not in roots else state[_MODEL]
    output = Path(output_path)
    partial = output.with_name(output.name + ".partial")
    torch.save(result, partial)
    os.replace(partial, output)


def _manifest_hints(directory: Path) -> dict[str, Any]:
    manifest_path = directory / MANIFEST_NAME
    return json.loads(manifest_path.read_text()) if manifest_path.exists() else {}


def _restore_scalar_shapes(state: dict[str, Any], scalar_params: set[str]) -> None:
    """Give 0-dim parameters (and their per-element optimizer state) back
    their shape: sharded checkpoints store them with shape (1,)."""
    model_state = state.get(_MODEL) or {}
    for key in scalar_params & set(model_state):
        model_state[key] = model_state[key].reshape(())
    optim_state = (state.get(_OPTIM) or {}).get("state", {})
    for fqn in scalar_params & set(optim_state):
        for key, value in optim_state[fqn].items():
            if key != "step" and isinstance(value, torch.Tensor) and value.shape == (1,):
                optim_state[fqn][key] = value.reshape(())


def torch_save_to_dcp(input_path: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str]) -> None:
    """Write a checkpoint directory (loadable by ``load_checkpoint`` at any
    world size) from a ``torch.save`` file of a model state dict (or of a
    nested ``{"model": ..., "optim": ...}`` state), with no process group."""
    state = torch.load(input_path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"torch_save_to_dcp({input_path}): expected a saved dict, got {type(state).__name__}.")
    if _MODEL not in state:
        state = {_MODEL: state}
    target = Path(checkpoint_dir)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(staging), no_dist=True)
    files = {p.name: _file_record(p) for p in staging.iterdir() if p.name.endswith(".distcp") or p.name == ".metadata"}
    _write_manifest(staging, files, list(state[_MODEL]), [])
    _switch_into_place(staging, target)
