"""Owns: a checkpoint directory's manifest — every file's size and checksum,
the model's key order, tied aliases and the optimizer's parameter names —
writing it, checking a directory against it (``verify_checkpoint``, the
ranks splitting the files), and the collective outcome of a step
(``agree``, ``rank0_step``).

Knows nothing of: models, optimizers, state dicts, what DCP writes inside
its files; how files are checksummed (checksums.py) or switched (switch.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from .. import comm
from .checksums import can_compute, digest_file
from .errors import CheckpointError, SwitchedButNotDurable
from .untrusted.safe_files import check_name, open_regular, read_bounded, resolve_inside
from .switch import fsync_dir

__all__ = [
    "MANIFEST_NAME",
    "verify_checkpoint",
    "manifest_hints",
    "write_manifest",
    "agree",
    "rank0_step",
    "current_rank",
    "current_world_size",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "composable_shard.manifest.json"
_FORMAT = 1


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
        # its 0-dim parameters stored with shape (1,) (written by earlier
        # versions; today's save writes none), and tied aliases ->
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
    fsync_dir(directory)

_MANIFEST_MAX_BYTES = 1 << 28


def verify_checkpoint(path: str | os.PathLike[str], *, ranks_share_work: bool = True, allow_links_outside: bool = False) -> bool:
    """Check a checkpoint directory against its manifest (every file's size
    and checksum, xxh3_64 or CRC-32) and raise ``CheckpointError`` naming the first bad files.
    Collective when a process group is initialised and ``ranks_share_work``
    (the ranks split the files by size). A directory without a
    manifest (written by plain ``dcp.save``) is checked for its metadata
    file only. Returns whether a manifest verified every file. Every file
    the manifest names must lie inside the directory as a regular file
    (``allow_links_outside`` as for ``load_checkpoint``)."""
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
    manifest = _read_manifest(directory, what)
    files = manifest["files"]
    share = ranks_share_work and dist.is_initialized()
    unverifiable = _unverifiable(files, what)
    if share:
        agree(unverifiable)  # every rank raises together
    _raise_if(unverifiable)
    rank, world = (current_rank(), current_world_size()) if share else (0, 1)
    mine = [(name, files[name]) for name in _share_of(files, rank, world)]
    bad = [_problem_of(directory, name, record, allow_links_outside) for name, record in mine]
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
        try:
            check_name(name, f"{what}: the manifest's file")
        except CheckpointError as exc:
            return str(exc)
        if not isinstance(record, dict) or type(record.get("bytes")) is not int or record["bytes"] < 0:
            return f"{what}: the manifest's record of '{name:.200}' is malformed. The checkpoint is damaged; load another one."
        if not isinstance(record.get("xxh3_64", ""), str) or type(record.get("crc32", 0)) is not int:
            return f"{what}: the manifest's checksum of '{name:.200}' is malformed. The checkpoint is damaged; load another one."
        if "xxh3_64" in record:
            if not can_compute("xxh3_64"):
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


def _problem_of(directory: Path, name: str, record: dict[str, Any], allow_links_outside: bool) -> str | None:
    """``_file_problem``, a refusal said as a problem (so every rank still
    joins the gather of problems)."""
    try:
        return _file_problem(directory, name, record, allow_links_outside)
    except CheckpointError as exc:
        return str(exc)


def _file_problem(directory: Path, name: str, record: dict[str, Any], allow_links_outside: bool) -> str | None:
    where = f"the manifest's file '{name}'"
    path = resolve_inside(directory, name, where, allow_links_outside=allow_links_outside)
    if not os.path.lexists(path):
        return f"file '{name}' is missing"
    stream, size = open_regular(path, where)  # a FIFO or device is refused here
    stream.close()
    if size != record["bytes"]:
        return f"file '{name}' has {size} bytes, the manifest records {record['bytes']} (truncated or overwritten)"
    algorithm = "xxh3_64" if "xxh3_64" in record else "crc32"
    if digest_file(path, algorithm) != record[algorithm]:
        return f"file '{name}' does not match its checksum (corrupted)"
    return None


def manifest_hints(directory: Path) -> dict[str, Any]:
    """The manifest's contents ({} for a directory without one), checked."""
    if not os.path.lexists(directory / MANIFEST_NAME):
        return {}
    return _read_manifest(directory, f"the checkpoint at '{directory}'")


def _read_manifest(directory: Path, what: str) -> dict[str, Any]:
    """The manifest, every field the loaders use checked for its type
    (``CheckpointError`` naming the field otherwise)."""
    where = f"{what}: the manifest {MANIFEST_NAME}"
    data = read_bounded(resolve_inside(directory, MANIFEST_NAME, where), where, _MANIFEST_MAX_BYTES)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is unreadable ({type(exc).__name__}: {str(exc)[:200]}). The checkpoint is damaged; load another one.") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where} has no 'files' table. The checkpoint is damaged; load another one.")

    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    checks = {
        "model_keys": strings,
        "scalar_params": strings,
        "aliases": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
        "optim_param_groups": lambda v: isinstance(v, list) and all(strings(group) for group in v),
    }
    for field, check in checks.items():
        if field in manifest and not check(manifest[field]):
            raise CheckpointError(f"{where}: its field '{field}' is malformed. The checkpoint is damaged; load another one.")
    return manifest
