"""Owns: making every rank raise the same refusal before any rank writes —
one small all-reduce of a failure flag, then (only after a refusal) the
first refusing rank's error broadcast to all.

Knows nothing of: files, pickles, what was refused (reader.py checks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .errors import CheckpointError, UnsafeCheckpointError, UnsafeTensorItemError

__all__ = ["agree_on_refusal", "refusal_before_writing"]


def _kinds() -> dict[str, type[CheckpointError]]:
    from .untrusted.metadata_checks import MalformedMetadataError

    return {kind.__name__: kind for kind in (CheckpointError, UnsafeCheckpointError, UnsafeTensorItemError, MalformedMetadataError)}


def agree_on_refusal(refusal: CheckpointError | None) -> CheckpointError | None:
    """The refusal of the lowest rank that refused (the same on every rank
    of the default group), or None if none did. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return refusal
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([world - rank if refusal is not None else 0], dtype=torch.int64, device=device)
    comm.all_reduce_max(flag, None)
    if int(flag.item()) == 0:
        return None
    first = world - int(flag.item())
    kind, message = comm.broadcast_object((type(refusal).__name__, str(refusal)) if rank == first else None, first)
    agreed = _kinds().get(kind, CheckpointError)(message)
    agreed.before_writing = True  # type: ignore[attr-defined]
    return agreed


def refusal_before_writing(exc: BaseException) -> CheckpointError | None:
    """The refusal behind a failed ``dcp.load`` that a reader raised before
    it wrote anything (DCP wraps every rank's exception: the lowest rank's),
    or None."""
    if isinstance(exc, CheckpointError) and getattr(exc, "before_writing", False):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            found = refusal_before_writing(cause) if isinstance(cause, BaseException) else None
            if found is not None:
                return found
    cause = exc.__cause__ or exc.__context__
    return refusal_before_writing(cause) if isinstance(cause, BaseException) and cause is not exc else None
