"""Owns: the small models the tests train (a GPT-like stack with a tied
embedding and head, norms, biases; variants with frozen parameters, with
buffers and extra state, with activation checkpointing, wide ones; the
small modules of the ports of FSDP2's scenarios).

Knows nothing of: composable_shard (tests apply fully_shard themselves).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB = 32
DIM = 16
SEQ = 6


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, dim: int = DIM, hidden: int = 3 * DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc_in = nn.Linear(dim, hidden)
        self.fc_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class TinyGPT(nn.Module):
    """Embedding -> blocks -> norm -> head, head tied to the embedding."""

    def __init__(self, n_blocks: int = 3, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update."""

    def __init__(self, dim: int = DIM, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoRABlock(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = LoRALinear(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class LoRAGPT(TinyGPT):
    """TinyGPT whose blocks mix frozen and trainable parameters."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__(n_blocks=0)
        self.blocks = nn.ModuleList([LoRABlock() for _ in range(n_blocks)])


class MLP(nn.Module):
    """in_proj -> relu -> out_proj, optionally with a buffer added to the
    output (the shape of FSDP2's test MLP, for the ports of its scenarios)."""

    def __init__(self, dim: int, hidden_multiplier: int = 4, *, bias: bool = True, with_buffer: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * hidden_multiplier, bias=bias)
        self.out_proj = nn.Linear(dim * hidden_multiplier, dim, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(F.relu(self.in_proj(x)))
        return z + self.buffer if self.buffer is not None else z


class _Counter(nn.Module):
    """A module with extra state (a step counter) besides its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def get_extra_state(self) -> Any:
        return {"count": self.count}

    def set_extra_state(self, state: Any) -> None:
        self.count = state["count"]


class BufferedGPT(TinyGPT):
    """TinyGPT with persistent and non-persistent buffers, extra state and a
    0-dim parameter (a learned temperature)."""

    def __init__(self, n_blocks: int = 3, dim: int = DIM) -> None:
        super().__init__(n_blocks=n_blocks, dim=dim)
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        for block in self.blocks:
            block.register_buffer("seen", torch.arange(4.0))
        self.counter = _Counter()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.temperature


class FunctionCheckpointGPT(TinyGPT):
    """Calls torch.utils.checkpoint.checkpoint on each block."""

    use_reentrant = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.norm(x))


def function_checkpoint_gpt(use_reentrant: bool) -> nn.Module:
    model = FunctionCheckpointGPT()
    model.use_reentrant = use_reentrant
    return model


WIDE = 1024


class WideGPT(TinyGPT):
    """TinyGPT with three 1024-wide blocks (8.4M parameters, 32 MiB in fp32
    each): every block's upload or copy takes milliseconds, while the 8 x 6
    token batch computes in microseconds. Embeddings start small (std 0.02)
    so that the tied head's logits stay of order one."""

    def __init__(self) -> None:
        super().__init__(n_blocks=0, dim=WIDE)
        self.blocks = nn.ModuleList([Block(WIDE, 4 * WIDE) for _ in range(3)])
        with torch.no_grad():
            self.tok_emb.weight.normal_(0.0, 0.02)


def big_gpt() -> nn.Module:
    return WideGPT()


class TwoHeads(nn.Module):
    """Two linears on the same input; the second may be left out of forward
    (12 wide by default, the width of the ports of FSDP2's autograd tests)."""

    def __init__(self, use_second: bool = True, dim: int = 12) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second = use_second

    def forward(self, x: torch.Tensor) -> Any:
        first = torch.relu(self.lin1(x))
        if not self.use_second:
            return first
        return first, torch.relu(self.lin2(x))


def batch(step: int, global_batch: int = 8, seq: int = SEQ, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, identical on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
