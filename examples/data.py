"""Offline training text: the Python standard library's own source, as bytes.

Owns: a byte-level token stream that every machine with Python has, random
(x, y) batches from it, and each data-parallel rank's slice of a global batch.
Knows nothing of: models, sharding, process groups.

Tokens are raw bytes (vocabulary 256), read from the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]``: depth first, names sorted, installed
packages (``site-packages``, ``dist-packages``) and caches skipped, until
``max_bytes`` are read. The same Python install gives the same tokens on every
rank. The first 90% is ``"train"``, the rest ``"val"``.

Usage::

    from data import ByteCorpus, rank_slice
    corpus = ByteCorpus.from_stdlib(max_bytes=2_000_000)
    gen = torch.Generator().manual_seed(step)            # same seed on every rank
    x, y = corpus.get_batch("train", batch_size=16, block_size=128, generator=gen)
    x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)

Drawing the *global* batch on every rank and slicing it makes a run at one
world size see exactly the data a run at another sees (and a single process
on the global batch), so losses are comparable.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["VOCAB_SIZE", "ByteCorpus", "stdlib_bytes", "rank_slice"]

VOCAB_SIZE = 256  # one token per byte value
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_bytes(max_bytes: int, root: str | os.PathLike | None = None) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``*.py`` source, read in a
    fixed order (depth first, names sorted). Raises if the directory holds no
    Python source at all."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    remaining = max_bytes
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)  # prunes the walk
        for name in sorted(filenames):
            if remaining <= 0:
                return b"".join(chunks)
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read(remaining))
                remaining -= len(chunks[-1])
    if not chunks or remaining == max_bytes:
        raise FileNotFoundError(
            f"stdlib_bytes: no *.py files under {str(root)!r}. "
            "Pass root= pointing at a directory of Python source."
        )
    return b"".join(chunks)


@dataclass
class ByteCorpus:
    train: torch.Tensor  # 1-D int64 tokens, first 90%
    val: torch.Tensor  # 1-D int64 tokens, last 10%

    @classmethod
    def from_stdlib(cls, max_bytes: int = 2_000_000, val_fraction: float = 0.1) -> ByteCorpus:
        raw = stdlib_bytes(max_bytes)
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()  # (N,)
        n_train = int(len(tokens) * (1.0 - val_fraction))
        return cls(train=tokens[:n_train], val=tokens[n_train:])

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: inputs ``x`` and next-token targets
        ``y``, both (batch_size, block_size) int64 on CPU. Deterministic given
        the generator's state."""
        if split not in ("train", "val"):
            raise ValueError(f"get_batch: split={split!r}; use 'train' or 'val'.")
        tokens = self.train if split == "train" else self.val
        if len(tokens) <= block_size + 1:
            raise ValueError(
                f"get_batch: the {split} split has {len(tokens)} tokens, too few for "
                f"block_size={block_size}. Read more bytes or shorten the block."
            )
        starts = torch.randint(len(tokens) - block_size - 1, (batch_size,), generator=generator)
        windows = torch.stack([tokens[s : s + block_size + 1] for s in starts.tolist()])  # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This data-parallel rank's rows of a global batch: rank r takes the r-th
    of ``world_size`` equal contiguous chunks."""
    if batch.shape[0] % world_size != 0:
        raise ValueError(
            f"rank_slice: global batch size {batch.shape[0]} is not divisible by "
            f"world_size={world_size}. Pick a batch size that is a multiple of it."
        )
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]
