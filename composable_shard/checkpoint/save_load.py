"""Owns: ``save_checkpoint`` / ``load_checkpoint`` of a model (and
optimizer) as a checkpoint directory through ``torch.distributed.checkpoint``:
a failed save never damages the previous checkpoint, and a damaged,
incomplete or foreign checkpoint is refused before anything changes.

Knows nothing of: flat parameters, hooks (it goes through the state-dict
functions); checksums, the manifest and the switch (checksums.py,
manifest.py, switch.py); what the metadata says (destinations.py); how
tensors are read (reader.py).

[Note: checkpoint safety]
A directory holds DCP's files of ``{"model", "optim", "extra"}`` and our
manifest (every file's size and checksum). Saving writes ``<dir>.partial``,
checksumming as DCP writes; rank 0 writes the manifest last and switches the
directory into place atomically (``renameat2(RENAME_EXCHANGE)``, else two
renames through ``<dir>.previous``), so ``<dir>`` is always a complete
checkpoint. Every step's outcome is broadcast, so all ranks raise together.

Loading checks before it reads: the files against the manifest (the ranks
split them), the metadata's keys and shapes against the model and optimizer,
the optimizer's groups (recorded in the manifest); then DCP reads straight
into the shards and the optimizer's state (``DirectFileSystemReader``, which
checks every item before its first write and has the ranks agree, see
[Note: everything checked before the first write] in reader.py), and the
setters' copies are skipped (same memory). After the checks only an I/O
error can fail the read, and its message says the model may hold part of
it. A directory without a manifest (plain ``dcp.save``) is read into new
buffers and copied in only once the whole read succeeded. Pinned by
tests/checkpoint/test_resume.py, tests/checkpoint/test_files.py and
tests/checkpoint/test_checksums.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from .. import comm
from ..state_dict.entries import model_entries, prepare_units
from ..state_dict.model import get_model_state_dict, set_model_state_dict
from ..state_dict.optim import check_optimizer_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from .checksums import ChecksummingFileSystem, file_record
from .destinations import EXTRA, MODEL, OPTIM, model_destination, optim_destination, optim_key, saved_paths
from .errors import CheckpointError, UnsafeCheckpointError
from .manifest import agree, current_rank, manifest_hints, rank0_step, verify_checkpoint, write_manifest
from .planners import DestinationLoadPlanner, TiedOnceFileSystemWriter, TiedOnceSavePlanner
from .untrusted.reader import DirectFileSystemReader
from .refusals import refusal_before_writing
from .untrusted.safe_pickle import PickleTrust, refusal_in
from .switch import clear_staging, switch_into_place

__all__ = ["save_checkpoint", "load_checkpoint"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- save
def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    extra_state: dict[str, Any] | None = None,
) -> None:
    """Save ``module`` (and ``optimizer`` — one, or a list such as ``[muon,
    adamw]`` — and picklable ``extra_state``) as a sharded checkpoint
    directory at ``path``, replacing any checkpoint there only once the new
    one is complete. See [Note: checkpoint safety].

    Collective: every rank calls it with the same ``path`` (on a file system
    all ranks share). Each rank writes only what it holds.
    """
    target = Path(path)
    what = f"save_checkpoint({target})"
    staging = target.with_name(target.name + ".partial")
    entries = model_entries(module, prepare_units(module, "save_checkpoint"))
    tied: dict[tuple[str, ...], tuple[str, ...]] = {
        (MODEL, alias): (MODEL, entry.keys[0]) for entry in entries.sharded for alias in entry.keys[1:]
    }
    state: dict[str, Any] = {MODEL: get_model_state_dict(module)}
    for index, each in enumerate(_optimizers(optimizer, what)):
        state[optim_key(index)] = get_optimizer_state_dict(module, each)
    if extra_state:
        state[EXTRA] = dict(extra_state)

    rank0_step(f"{what}: cannot create the staging directory '{staging}'", lambda: clear_staging(staging))
    error = None
    checksums: ChecksummingFileSystem | None = None
    try:
        writer = TiedOnceFileSystemWriter(staging, aliases=tied)  # see [Note: tied aliases written once]
        checksums = ChecksummingFileSystem.attach(writer)  # checksums while writing, not by reading back
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
        write_manifest(staging, files, entries.key_order, [], aliases, groups)
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
    module: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    strict: bool = True,
    trusted: bool = False,
    safe_globals: Sequence[Any] | None = None,
    allow_links_outside: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint directory (from ``save_checkpoint``, any world size
    or strategy) into ``module`` (and ``optimizer``: one, or the list of
    optimizers it was saved with, in the same order); returns the saved
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
    checkpoint you trust unrestricted.

    Safe against any bytes: every file it names must lie inside the
    directory (``allow_links_outside=True`` follows symbolic links leading
    out of it) and be a regular file; every item is checked before the first
    byte lands, and the ranks agree, so a refusal leaves the model and
    optimizer unchanged on every rank (see [Note: everything checked before
    the first write] in reader.py)."""
    directory = Path(path)
    what = f"load_checkpoint({directory})"
    trust = PickleTrust.of(trusted, safe_globals, allow_links_outside)
    # 1. Verify the files: only files checked against the manifest are read in place.
    in_place = verify_checkpoint(directory, allow_links_outside=trust.allow_links_outside)
    # 2. Build the destinations from the metadata, checked against the model and optimizer.
    saved = saved_paths(_read_metadata(directory, what, trust))
    entries = model_entries(module, prepare_units(module, "load_checkpoint"))
    optimizers = _optimizers(optimizer, what)
    destination: dict[str, Any] = {MODEL: model_destination(entries, saved, strict, what, in_place=in_place)}
    # The rest (extra states and extra_state, step and hyperparameters) the planner fills from the metadata.
    fill = [(EXTRA,), *((MODEL, key) for key in entries.extra_states)]
    if any(path[0] == EXTRA for path, _ in saved.values()):
        destination[EXTRA] = {}  # dcp.load keeps only the top-level keys it is given
    options = StateDictOptions(strict=strict)
    for index, each in enumerate(optimizers):
        key = optim_key(index)
        destination[key] = optim_destination(entries, each, saved, strict, what, in_place=in_place, key=key)
        fill += [(key, "param_groups"), *((key, "state", fqn) for fqn in destination[key]["state"])]
        to_check = _optim_to_check(directory, destination[key], what, trust, key=key)
        check_optimizer_state_dict(module, each, to_check, options=options)
    # 3. Read the tensors into the destinations.
    _read(directory, destination, what, trust, in_place=in_place, planner=DestinationLoadPlanner(tuple(fill)))
    # 4. Finish: the setters' copies are skipped where the destination is the model's own memory.
    set_model_state_dict(module, destination[MODEL], options=options)
    for index, each in enumerate(optimizers):
        set_optimizer_state_dict(module, each, destination[optim_key(index)], options=options)
    logger.info("%s: loaded%s", what, " in place" if in_place else " through new buffers (no manifest)")
    return dict(destination.get(EXTRA) or {})


def _read_metadata(directory: Path, what: str, trust: PickleTrust) -> Metadata:
    """The checkpoint's DCP metadata, read as data (see [Note: checkpoints
    are data]); a damaged file is a ``CheckpointError``."""
    try:
        return _reader(directory, trust).read_metadata()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{what}: {exc}") from None
    except CheckpointError as exc:  # its kind kept (MalformedMetadataError, ...)
        raise type(exc)(f"{what}: cannot read the checkpoint's metadata: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged metadata file; say so clearly
        raise CheckpointError(
            f"{what}: cannot read the checkpoint's metadata ({type(exc).__name__}: {exc}). The checkpoint is "
            "damaged or incomplete; load another one. Nothing was loaded."
        ) from exc


def _optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, what: str
) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list (one, several, or none)."""
    if optimizer is None:
        return []
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    wrong = [type(each).__name__ for each in optimizers if not isinstance(each, torch.optim.Optimizer)]
    if wrong:
        raise TypeError(
            f"{what}: optimizer must be a torch.optim.Optimizer or a list of them, got {', '.join(wrong)}. "
            "Nothing was read or written."
        )
    return optimizers


def _optim_to_check(
    directory: Path, optim: dict[str, Any], what: str, trust: PickleTrust, *, key: str = OPTIM
) -> dict[str, Any]:
    """The optimizer destination as ``check_optimizer_state_dict`` needs it,
    before any tensor is read: its parameter names per group from the
    manifest (the first optimizer's), or its objects read first."""
    groups = manifest_hints(directory).get("optim_param_groups") if key == OPTIM else None
    if isinstance(groups, list):
        return {"state": optim["state"], "param_groups": [{"params": list(names)} for names in groups]}
    objects: dict[str, Any] = {key: {}}  # hyperparameters: a few bytes, read on their own
    _read(directory, objects, what, trust, in_place=False, planner=DestinationLoadPlanner(((key,),), objects_only=True))
    return {"state": optim["state"], "param_groups": objects[key].get("param_groups")}


def _reader(directory: Path, trust: PickleTrust) -> DirectFileSystemReader:
    return DirectFileSystemReader(
        directory,
        trusted=trust.trusted,
        safe_globals=trust.safe_globals,
        allow_links_outside=trust.allow_links_outside,
        agree_before_writing=True,
    )


def _read(
    directory: Path, destination: dict[str, Any], what: str, trust: PickleTrust, *, in_place: bool, planner: DestinationLoadPlanner
) -> None:
    try:
        dcp.load(destination, storage_reader=_reader(directory, trust), planner=planner)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank
        refusal = refusal_before_writing(exc) or refusal_in(exc)
        if refusal is not None:  # every rank agreed on it before any rank wrote
            raise type(refusal)(f"{what}: {refusal} The model and optimizer were not changed.") from None
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
