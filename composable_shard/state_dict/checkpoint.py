"""Owns: checkpoint directories — ``save_checkpoint`` / ``load_checkpoint``
of a model (and optimizer) through ``torch.distributed.checkpoint``, written
so that a failed save never damages the previous checkpoint and a damaged,
incomplete or foreign checkpoint is refused before anything is changed.

Knows nothing of: flat parameters, hooks (it goes through the state-dict
functions); the files' manifest and switch (files.py); what the metadata
says (destinations.py); how tensors are read from the files (reader.py); converting to other formats (convert.py, whose
``dcp_to_torch_save`` / ``torch_save_to_dcp`` this module re-exports for
their old import path).

Public names: ``save_checkpoint``, ``load_checkpoint``, ``CheckpointError``,
``MANIFEST_NAME``, ``verify_checkpoint``, ``dcp_to_torch_save``,
``torch_save_to_dcp``.

[Note: checkpoint safety]
A checkpoint directory holds the DCP files (``.metadata`` and one
``__<rank>_<n>.distcp`` per writing rank) of the nested state dict
``{"model": ..., "optim": ..., "extra": ...}`` plus our manifest
``composable_shard.manifest.json`` (every file's size and checksum:
xxh3_64 with the optional ``xxhash``, else CRC-32; files.py).

Saving writes into the sibling ``<dir>.partial`` (emptied first); each rank
checksums the files it writes (as DCP writes them, ``ChecksummingFileSystem``;
read back only where that is not possible); rank 0 writes the manifest last, then switches
the new directory into place: an atomic exchange of the two directories
(``renameat2(RENAME_EXCHANGE)`` on Linux) followed by deleting the old one,
or, where that is unavailable, two renames through ``<dir>.previous``. So at
every instant ``<dir>`` is either the complete old checkpoint or the complete
new one (in the two-rename fallback a crash between the renames leaves the
old one complete at ``<dir>.previous``, and ``load_checkpoint`` says so).
Every step's outcome is broadcast by rank 0, so all ranks raise together.

Loading validates everything before reading any tensor, then reads in
place:

1. the manifest: every file's size and checksum (the ranks split the files);
2. the DCP metadata against the model and optimizer: keys and shapes
   (``destinations.py``), with no tensor allocated;
3. the optimizer's parameter names per group, which the manifest records
   (for a checkpoint without them, its objects are read first: a few
   bytes), so the optimizer state dict is checked as a whole;
4. then DCP reads the tensors straight into the model's shards and the
   optimizer's state tensors (no second copy of the model in memory), and
   ``set_model_state_dict`` / ``set_optimizer_state_dict`` finish (their
   copies are skipped: source and target are the same memory). The storage
   reader is ours, ``DirectFileSystemReader`` (reader.py): it copies each
   tensor's bytes from the file into its destination once, where PyTorch's
   ``FileSystemReader`` builds a temporary tensor per item with
   ``torch.load`` and copies again, with the same result (see [Note: direct
   reads]). With it, checks and read together take less time than a plain
   ``dcp.load`` through PyTorch's reader (README, Checkpoints). Loading
   without a manifest (below) reads through it as well.

No step runs code from the files: ``.metadata`` and every object (extra
states, hyperparameters, ``extra_state``) are read as data, and a pickle
that wants more is refused (``UnsafeCheckpointError``) before any value is
handed over; see [Note: checkpoints are data] in safe_pickle.py.

Saving: the parent directory is fsynced right after the switch; an old
checkpoint that cannot be deleted afterwards (a file held open on NFS) is a
warning, and the next save moves it aside (``clear_staging``).

A refused checkpoint therefore changes nothing. Once step 1 verified every
file, the read in step 4 can only fail on an I/O error, and that error says
the model may hold part of the checkpoint. A directory without a manifest
(plain ``dcp.save``) cannot be verified in step 1, so it is read into new
buffers instead and copied in only after the whole read succeeded (the cost
of one extra copy of this rank's shards and optimizer state).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from .. import comm
from .convert import dcp_to_torch_save, torch_save_to_dcp
from .destinations import (
    EXTRA,
    MODEL,
    OPTIM,
    fill_objects,
    model_destination,
    objects_tree,
    optim_destination,
    saved_paths,
    SavedPaths,
    template,
)
from .files import (
    MANIFEST_NAME,
    CheckpointError,
    ChecksummingFileSystem,
    agree,
    clear_staging,
    current_rank,
    file_record,
    manifest_hints,
    rank0_step,
    switch_into_place,
    verify_checkpoint,
    write_manifest,
)
from .entries import model_entries, prepare_units
from .model import get_model_state_dict, set_model_state_dict
from .optim import check_optimizer_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from .range_tensor import HAS_DCP_TENSOR_PROTOCOL
from .reader import DirectFileSystemReader
from .shards import stored_shape
from .tied_aliases import TiedOnceFileSystemWriter, TiedOnceSavePlanner
from .safe_pickle import PickleTrust, UnsafeCheckpointError, refusal_in

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

# Only where torch predates DCP's tensor protocol do our state dicts hold
# PyTorch's deprecated ShardedTensor, whose every access in DCP warns. See
# [Note: DCP tensor protocol].
_SHARDED_TENSOR_WARNING = "Please use DTensor instead and we are deprecating ShardedTensor"


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    if HAS_DCP_TENSOR_PROTOCOL:  # nothing deprecated is used: let every warning through
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SHARDED_TENSOR_WARNING, category=FutureWarning)
        yield


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
    # 0-dim parameters stored with shape (1,) (only under the ShardedTensor fallback now), for the converters.
    scalar_params = [
        key for entry in entries.sharded if stored_shape(entry.info.shape) != entry.info.shape for key in entry.keys
    ]
    tied = {(MODEL, alias): (MODEL, entry.keys[0]) for entry in entries.sharded for alias in entry.keys[1:]}
    state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIM] = get_optimizer_state_dict(model, optimizer)
    if extra_state:
        state[EXTRA] = dict(extra_state)

    rank0_step(f"{what}: cannot create the staging directory '{staging}'", lambda: clear_staging(staging))
    error = None
    checksums: ChecksummingFileSystem | None = None
    try:
        writer = TiedOnceFileSystemWriter(staging, aliases=tied)  # see [Note: tied aliases written once]
        checksums = ChecksummingFileSystem.attach(writer)  # checksums while writing, not by reading back
        with _quiet_sharded_tensor():
            dcp.save(state, storage_writer=writer, planner=TiedOnceSavePlanner(tied))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank; say what is left
        error = (
            f"{what}: writing the checkpoint failed ({_describe(exc)}). The checkpoint at '{target}' (if any) is "
            "unchanged."
        )
    agree(error)
    own: dict[str, dict[str, int]] = {}
    try:
        own = {p.name: _record(p, checksums) for p in staging.glob(f"__{current_rank()}_*.distcp")}
    except OSError as exc:
        error = f"{what}: cannot read back the files this rank wrote ({exc}). '{target}' is unchanged."
    records = comm.all_gather_object(own) if dist.is_initialized() else [own]
    agree(error)

    def finish() -> None:
        files = {name: record for rank_records in records for name, record in rank_records.items()}
        files[".metadata"] = file_record(staging / ".metadata")
        aliases = {alias: entry.keys[0] for entry in entries.sharded for alias in entry.keys[1:]}
        groups = [list(group["params"]) for group in state[OPTIM]["param_groups"]] if OPTIM in state else None
        write_manifest(staging, files, entries.key_order, scalar_params, aliases, groups)
        switch_into_place(staging, target)

    rank0_step(f"{what}: cannot finish the checkpoint (the previous one at '{target}' is intact)", finish)
    logger.info("%s: saved", what)


def _record(path: Path, checksums: ChecksummingFileSystem | None) -> dict[str, int]:
    """A file's manifest record: the one taken while writing it when its
    size agrees, else read back."""
    record = checksums.records.get(path.name) if checksums is not None else None
    if record is None or record["bytes"] != path.stat().st_size:
        return file_record(path)
    return record


# ------------------------------------------------------------------- load
def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    trusted: bool = False,
    safe_globals: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint directory (from ``save_checkpoint``, any world size
    or strategy) into ``model`` (and ``optimizer``); returns the saved
    ``extra_state`` (``{}`` if none). Raises ``CheckpointError`` for a missing
    or damaged checkpoint and ``StateDictError`` for one of another model
    (missing, unexpected or differently shaped keys), in both cases before
    changing anything; reads in place once it is checked (see [Note:
    checkpoint safety]). With ``strict=False`` only the keys both have are
    loaded. Collective: every rank calls it.

    Never runs code from the files: their pickles are read as data, and one
    that wants anything else is refused (``UnsafeCheckpointError``, a
    ``CheckpointError``) before anything changes; see [Note: checkpoints are
    data]. ``safe_globals`` admits more types (so does
    ``torch.serialization.add_safe_globals``); ``trusted=True`` reads a
    checkpoint you trust unrestricted."""
    directory = Path(path)
    what = f"load_checkpoint({directory})"
    trust = PickleTrust.of(trusted, safe_globals)
    # 1. Verify the files: only files checked against the manifest are read in place.
    in_place = verify_checkpoint(directory)
    # 2. Build the destinations from the metadata, checked against the model and optimizer.
    saved = saved_paths(_read_metadata(directory, what, trust))
    entries = model_entries(model, prepare_units(model, "load_checkpoint"))
    destination: dict[str, Any] = {MODEL: model_destination(entries, saved, strict, what, in_place=in_place)}
    options = StateDictOptions(strict=strict)
    if optimizer is not None:
        destination[OPTIM] = optim_destination(entries, optimizer, saved, strict, what, in_place=in_place)
        to_check = _optim_to_check(directory, destination[OPTIM], saved, what, trust)
        check_optimizer_state_dict(model, optimizer, to_check, options=options)
    extra = template(saved, EXTRA)
    if extra is not None:
        destination[EXTRA] = extra
    # 3. Read the tensors into the destinations.
    _read(directory, destination, what, trust, in_place=in_place)
    # 4. Finish: the setters' copies are skipped where the destination is the model's own memory.
    set_model_state_dict(model, destination[MODEL], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, destination[OPTIM], options=options)
    logger.info("%s: loaded%s", what, " in place" if in_place else " through new buffers (no manifest)")
    return dict(destination.get(EXTRA) or {})


def _read_metadata(directory: Path, what: str, trust: PickleTrust) -> Metadata:
    """The checkpoint's DCP metadata, read as data (see [Note: checkpoints
    are data]); a damaged file is a ``CheckpointError``."""
    try:
        return _reader(directory, trust).read_metadata()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{what}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged metadata file; say so clearly
        raise CheckpointError(
            f"{what}: cannot read the checkpoint's metadata ({type(exc).__name__}: {exc}). The checkpoint is "
            "damaged or incomplete; load another one. Nothing was loaded."
        ) from exc


def _optim_to_check(directory: Path, optim: dict[str, Any], saved: SavedPaths, what: str, trust: PickleTrust) -> dict[str, Any]:
    """The optimizer destination as ``check_optimizer_state_dict`` needs it,
    before any tensor is read: its parameter names per group from the
    manifest, or (a checkpoint without them) its objects read first."""
    groups = manifest_hints(directory).get("optim_param_groups")
    if isinstance(groups, list):
        return {"state": optim.get("state", {}), "param_groups": [{"params": list(names)} for names in groups]}
    objects = objects_tree(saved, OPTIM)
    if objects is not None:  # hyperparameters: a few bytes, read on their own
        _read(directory, {OPTIM: objects}, what, trust, in_place=False)
        fill_objects(optim, objects)
    return optim


def _reader(directory: Path, trust: PickleTrust) -> DirectFileSystemReader:
    return DirectFileSystemReader(directory, trusted=trust.trusted, safe_globals=trust.safe_globals)


def _read(directory: Path, destination: dict[str, Any], what: str, trust: PickleTrust, *, in_place: bool) -> None:
    try:
        with _quiet_sharded_tensor():
            dcp.load(destination, storage_reader=_reader(directory, trust))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank
        refusal = refusal_in(exc)
        if refusal is not None:  # every rank refuses every bytes item before it reads a tensor
            state = (
                "Ranks that do not read that item may have read their part: load a checkpoint again before training."
                if refusal.others_may_have_read and in_place
                else "The model and optimizer were not changed."
            )
            raise type(refusal)(f"{what}: {refusal} {state}") from None
        state = (
            "It had passed its checks, so this is an I/O error; the model and optimizer may now hold part of it: "
            "load a checkpoint again before training."
            if in_place
            else "The checkpoint is damaged or incomplete; load another one. The model and optimizer were not changed."
        )
        raise CheckpointError(f"{what}: reading the checkpoint failed ({_describe(exc)}). {state}") from exc


def _describe(exc: BaseException) -> str:
    """The root cause of a DCP failure in one line (its exception lists
    every rank's traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (cause, _) = next(iter(sorted(exc.failures.items())))
        return f"on rank {rank}: {_describe(cause)}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
