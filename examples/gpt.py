"""A small GPT language model, written to be read (after karpathy/nanoGPT's model.py).

Owns: the model used by the examples and the benchmark: ``GPTConfig``, ``Block``,
``GPT`` and the AdamW parameter groups ``param_groups``.
Knows nothing of: sharding, process groups, data.

The model is a plain ``nn.Module`` tree, which is what ``fully_shard`` wants::

    GPT
    ├── tok_emb    Embedding(vocab_size, n_embd)       weight tied with lm_head
    ├── pos_emb    Embedding(block_size, n_embd)
    ├── drop       Dropout
    ├── blocks     ModuleList of n_layer × Block       one sharded unit each
    │   └── Block: ln_1 → attn (causal self-attention) → ln_2 → mlp (GELU)
    ├── ln_f       LayerNorm
    └── lm_head    Linear(n_embd, vocab_size, bias=False)

Usage::

    from gpt import GPT, GPTConfig, param_groups
    model = GPT(GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128), seed=0)
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int64
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)

Shape legend: B batch, T time (sequence), C channels (n_embd), nh heads,
hs head size (C // nh), V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "param_groups"]


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens: every byte value is a token
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # 0.0 keeps runs bit-comparable across parallelisms
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}. "
                "Pick an n_head that divides n_embd."
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """One pre-norm transformer block; the unit that ``fully_shard`` shards."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output head reads the token embedding matrix.
        # One nn.Parameter reached by two modules (both stay under the root unit).
        self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init: the same seed gives the same weights on every rank and
        machine (a private CPU generator, so the global RNG state does not matter)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():  # deterministic order: registration order
            self._init_weights(module, generator)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                _normal_(proj.weight, residual_std, generator)

    @staticmethod
    def _init_weights(module: nn.Module, generator: torch.Generator) -> None:
        if isinstance(module, nn.Linear):
            _normal_(module.weight, 0.02, generator)  # lm_head: the tied embedding, again
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            _normal_(module.weight, 0.02, generator)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights counted once); without the position
        embedding by default, as nanoGPT reports it. Before sharding only: after
        ``fully_shard`` each rank holds just its part."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"GPT: sequence length {T} is longer than block_size={self.config.block_size}. "
                "Use shorter sequences or a larger block_size."
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C) + (T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        # The loss in fp32 even when the model computes in bf16.
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))
        return logits, loss


def _normal_(weight: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``weight`` from N(0, std²) drawn on CPU, so that the values do not
    depend on the device the model was built on. A model built on the meta
    device has no values to fill: whoever materialises it initialises it
    (e.g. ``fully_shard(..., param_init_fn=...)``), so nothing is drawn."""
    if weight.is_meta:
        return
    with torch.no_grad():
        values = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
        values.normal_(0.0, std, generator=generator)
        weight.copy_(values)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on the weights of ``nn.Linear``
    layers only; none on norms, biases and embeddings. The tied embedding/head
    weight counts as an embedding (no decay). Each parameter appears once.

    Classifies by module type and attribute name, never by ``p.dim()``, so it
    gives the same groups before and after sharding (``fully_shard`` leaves
    each parameter a 1-D shard) and through FSDP / DDP wrappers.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            is_linear_weight = isinstance(module, nn.Linear) and name == "weight"
            if is_linear_weight and id(param) not in embedding_ids:
                decay.append(param)
            else:
                no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
