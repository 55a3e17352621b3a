"""Owns: several contiguous tensors read and written as one byte sequence,
laid back to back without a copy, and where a collective's bytes lie in its
tensors — what a shared-memory all-to-all ([Note: shared-memory all-to-all]
in collectives.py) and a coalesced collective send from and receive into,
and the byte views, offsets and overlaps the collectives locate bytes with.

Knows nothing of: slots, rounds, process groups.

Public names: ``Pieces``, ``transfer``, ``bytes_of``, ``has_storage``,
``offsets``, ``overlap``.
"""

from __future__ import annotations

import bisect
from typing import Iterator, Sequence

import torch

__all__ = ["Pieces", "transfer", "bytes_of", "has_storage", "offsets", "overlap"]


class Pieces:
    """``tensors`` (contiguous) as one sequence of bytes, in order."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        views = [bytes_of(tensor) for tensor in tensors]  # refuses strided tensors
        # Empty tensors hold no byte: leaving them out keeps every start unique.
        self._bytes = [view for view in views if view.numel()]
        self._starts = offsets([piece.numel() for piece in self._bytes])
        self.nbytes = sum(piece.numel() for piece in self._bytes)

    def has_storage(self) -> bool:
        """False once some piece's storage was resized away (a freed buffer:
        nothing may be written into it)."""
        return all(has_storage(piece) for piece in self._bytes)

    def spans(self, start: int, length: int) -> Iterator[tuple[torch.Tensor, int]]:
        """The bytes ``[start, start + length)`` piece by piece: each part as
        a view of its piece, with where it starts within the range."""
        index = max(bisect.bisect_right(self._starts, start) - 1, 0)
        end = start + length
        while index < len(self._bytes) and self._starts[index] < end:
            at = self._starts[index]
            low, high = overlap(at, self._bytes[index].numel(), start, length)
            if high > low:
                yield self._bytes[index][low - at : high - at], low - start
            index += 1

    def _locate(self, at: int) -> tuple[int, int]:
        """The piece holding byte ``at``, and where in it."""
        index = bisect.bisect_right(self._starts, at) - 1
        return index, at - self._starts[index]


def transfer(source: Pieces, source_at: int, target: Pieces, target_at: int, nbytes: int) -> None:
    """Copy ``nbytes`` bytes from ``source`` (from byte ``source_at``) to
    ``target`` (from byte ``target_at``), piece by piece."""
    if source_at < 0 or target_at < 0 or source_at + nbytes > source.nbytes or target_at + nbytes > target.nbytes:
        raise ValueError(
            f"shared-memory transfer of {nbytes} bytes from byte {source_at} of {source.nbytes} to byte "
            f"{target_at} of {target.nbytes}: out of range"
        )
    targets, sources = [], []
    while nbytes > 0:
        source_index, source_offset = source._locate(source_at)
        target_index, target_offset = target._locate(target_at)
        source_piece, target_piece = source._bytes[source_index], target._bytes[target_index]
        length = min(nbytes, source_piece.numel() - source_offset, target_piece.numel() - target_offset)
        targets.append(target_piece[target_offset : target_offset + length])
        sources.append(source_piece[source_offset : source_offset + length])
        source_at, target_at, nbytes = source_at + length, target_at + length, nbytes - length
    if targets:
        torch._foreach_copy_(targets, sources)  # one call for every piece's copy


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("shared-memory collectives need contiguous tensors")
    if tensor.dim() == 1:  # every flat buffer: one view, not two
        return tensor.view(torch.uint8)
    return tensor.reshape(-1).view(torch.uint8)


def has_storage(tensor: torch.Tensor) -> bool:
    """False once the tensor's storage was resized away (a freed buffer)."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() >= needed


def offsets(sizes: list[int]) -> list[int]:
    """Where each of ``sizes``, laid back to back, starts."""
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts


def overlap(start: int, length: int, window_start: int, window_length: int) -> tuple[int, int]:
    """The part of ``[start, start + length)`` in the window, as (low, high);
    empty where ``high <= low``."""
    return max(start, window_start), min(start + length, window_start + window_length)
