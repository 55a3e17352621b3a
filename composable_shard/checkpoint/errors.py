"""Owns: the exceptions of checkpoint directories: ``CheckpointError`` (a
missing, damaged, incomplete or foreign checkpoint, or a failed write),
``SwitchedButNotDurable``, and the refusals of pickles that want more than
data (``UnsafeCheckpointError``, ``UnsafeTensorItemError``).

Knows nothing of: files, pickles, models (the raisers word the messages).
"""

from __future__ import annotations

__all__ = ["CheckpointError", "SwitchedButNotDurable", "UnsafeCheckpointError", "UnsafeTensorItemError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, damaged or incomplete, or writing
    one failed. Raised before the model or optimizer is changed."""


class SwitchedButNotDurable(CheckpointError):
    """The new checkpoint is in place, but syncing its parent directory
    failed, so a crash may still bring the previous one back."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's pickle names a global that loading does not admit;
    refused before anything was built from it."""

    # Whether other ranks may have read their part before this rank refused
    # (a tensor item under a plain dcp.load without agree_before_writing: only
    # the ranks that read it refuse it; load_checkpoint's ranks agree first).
    others_may_have_read = False


class UnsafeTensorItemError(UnsafeCheckpointError):
    """A tensor item's pickle wants more than a tensor."""

    others_may_have_read = True
