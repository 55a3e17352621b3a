"""Owns: finding the newest complete checkpoint in a directory of
checkpoints (``latest_checkpoint``), the one a restarted job resumes from.

Knows nothing of: models, optimizers, what the files hold (``verify_checkpoint``
in manifest.py checks them), how a save stages and switches (switch.py).

Public names: ``latest_checkpoint``.

[Note: the newest complete checkpoint]
A job that saves ``save_checkpoint(save_dir / f"step_{step}", ...)`` every
few steps and is killed at any moment (torchrun's elastic agent then starts
every worker again with the same command) must resume from the newest
checkpoint that a save finished, and start fresh when there is none. A save
writes ``<name>.partial`` and switches it into place only once complete
(``<name>.previous`` exists for a moment where the platform lacks an atomic
exchange), so a directory whose name is not one of those is complete unless
its files were damaged afterwards; ``verify=True`` checks them against the
manifest (the ranks split the files) and passes over a damaged one to the
next newest, with a warning. "Newest" is the largest number in the name
(the last run of digits: ``step_000120``, ``ckpt-120``, ``epoch_3``), not a
file time, which a copy or a clock can change; names without a number are
not candidates. Rank 0 lists the directory and every rank takes its list,
so all ranks check the same candidates in the same order (a collective,
like ``load_checkpoint``). Leftover ``.partial`` directories are left where
they are: the next save of that name clears them (``clear_staging``).
Pinned by tests/elastic/test_latest_checkpoint.py and
tests/elastic/test_torchrun_restarts.py.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch.distributed as dist

from .. import comm
from .errors import CheckpointError
from .manifest import MANIFEST_NAME, current_rank, verify_checkpoint

__all__ = ["latest_checkpoint"]

logger = logging.getLogger(__name__)

_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
# What a save leaves beside a checkpoint while (or after failing to finish)
# writing it; never candidates (switch.py names them).
_STAGING = re.compile(r"\.partial$|\.previous$|\.partial\.stale-\d+$")
_DAMAGED_LIMIT = 3  # damaged candidates named in the warning


def latest_checkpoint(save_dir: str | os.PathLike[str], *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint directory under ``save_dir``, or None
    when there is none (a first start: ``save_dir`` missing or empty).

    Candidates are the subdirectories whose name holds a number and that
    hold a checkpoint (``save_checkpoint``'s manifest, or a plain
    ``dcp.save``'s ``.metadata``); the newest has the largest last number in
    its name. Staging directories (``*.partial``, ``*.previous``) are never
    candidates. With ``verify=True`` (the default) each candidate, newest
    first, is checked against its manifest (every file's size and checksum,
    the ranks splitting the files) and a damaged one is skipped with a
    warning; ``verify=False`` trusts the names (``load_checkpoint`` checks
    the files anyway, but cannot fall back to an older one).

    Collective when a process group is initialised: every rank calls it,
    with the same ``save_dir`` on a file system all ranks share, and gets
    the same answer. See [Note: the newest complete checkpoint].
    """
    directory = Path(save_dir)
    what = f"latest_checkpoint('{directory}')"
    listing: list[str] | str | None = None
    if current_rank() == 0:
        listing = _listing(directory, what)
    if dist.is_initialized():
        listing = comm.broadcast_object(listing)
    if isinstance(listing, str):  # rank 0's refusal, raised on every rank
        raise NotADirectoryError(listing)
    candidates = [directory / name for name in listing or []]
    damaged: list[str] = []
    for candidate in candidates:
        if not verify:
            return candidate
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            damaged.append(str(exc))
            logger.warning("%s: skipping the damaged checkpoint '%s': %s", what, candidate, exc)
            continue
        return candidate
    if damaged:
        logger.warning(
            "%s: none of the %d checkpoints verified (%s); starting without one",
            what, len(damaged), "; ".join(damaged[:_DAMAGED_LIMIT]),
        )
    return None


def _listing(directory: Path, what: str) -> list[str] | str:
    """The candidates' names, newest first; or why ``directory`` cannot
    hold checkpoints (a message, raised on every rank)."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        return f"{what}: '{directory}' is not a directory. Pass the directory the checkpoints are saved under."
    numbered: list[tuple[int, str]] = []
    for entry in os.scandir(directory):
        found = _LAST_NUMBER.search(entry.name)
        if found is None or _STAGING.search(entry.name) or not entry.is_dir():
            continue
        path = Path(entry.path)
        if (path / MANIFEST_NAME).exists() or (path / ".metadata").exists():
            numbered.append((int(found.group(1)), entry.name))
    return [name for _, name in sorted(numbered, reverse=True)]
