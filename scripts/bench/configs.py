"""Owns: the model configurations of ``--config``: each one's sizes (fp32,
and smaller ones for bf16 on CPU) and what it changes in the example GPT
(the LoRA adapters of ``lora``).

Knows nothing of: the modes, processes, timing (``models.py`` builds the
model a configuration describes).

Adding a configuration is one ``Config`` entry in ``CONFIGS`` (plus, if it
changes the model beyond its sizes, its ``customize`` function here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

# The sizes a configuration fixes; each has a command-line override (--n-layer, ...).
SIZE_ARGS = ("n_layer", "n_embd", "n_head", "block_size", "batch_size")


@dataclass(frozen=True)
class Config:
    """One ``--config`` choice. ``sizes`` / ``bf16_cpu_sizes``: a value for each
    of ``SIZE_ARGS`` (``batch_size`` is the global batch); the second set is used
    with ``--mixed-precision bf16`` on CPU. ``customize(model, seed)``, if any,
    changes the full GPT in place before any mode wraps it."""

    summary: str
    sizes: dict[str, int]
    bf16_cpu_sizes: dict[str, int]
    customize: Callable[[nn.Module, int], None] | None = None
    # Build the model on the meta device; each mode materialises it its own
    # documented way, shard by shard (models.py, peers.py).
    deferred_init: bool = False
    # What the run does: "compare" (timing and memory passes, cli.py) or
    # "largest" (the search for the largest n_layer that trains, largest.py).
    run: str = "compare"

    def sizes_for(self, mixed_precision: str, device: str) -> dict[str, int]:
        return self.bf16_cpu_sizes if mixed_precision == "bf16" and device == "cpu" else self.sizes


LORA_RANK = 8
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A``
    (``B`` starts at zero, so the model starts as the base model)."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features).normal_(0.0, 0.02, generator=generator))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t().to(x.dtype)) @ self.lora_b.t().to(x.dtype)


def add_lora(model: nn.Module, seed: int) -> None:
    """Freeze every parameter, then put LoRA adapters on each block's Linears."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed + 1)
    for block in model.blocks:
        for path in LORA_TARGETS:
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), LORA_RANK, generator))


_GPT = dict(n_layer=8, n_embd=256, n_head=8, block_size=128, batch_size=8)
_GPT_BF16_CPU = dict(n_layer=4, n_embd=128, n_head=4, block_size=64, batch_size=4)

CONFIGS: dict[str, Config] = {
    "gpt": Config("the example GPT (8 blocks, width 256), every block one unit", _GPT, _GPT_BF16_CPU),
    "lora": Config(
        "the same GPT with its base frozen and trainable rank-8 LoRA adapters on the four Linear layers "
        "of every block (the fine-tuning case: most parameters need no gradient)",
        _GPT,
        _GPT_BF16_CPU,
        customize=add_lora,
    ),
    "largest": Config(
        "the largest number of blocks of width 1,280 (--n-embd 1536 for the other width) that trains "
        "3 AdamW steps per mode, each trial in fresh processes under a memory watchdog; models built "
        "on the meta device; n_layer is found, not given",
        dict(n_layer=1, n_embd=1280, n_head=16, block_size=128, batch_size=2),
        dict(n_layer=1, n_embd=1280, n_head=16, block_size=128, batch_size=2),
        deferred_init=True,
        run="largest",
    ),
    "gpt-326m": Config(
        "a realistic size on CPU: 16 blocks of width 1,280 (315M parameters, 75 MiB per block in fp32), "
        "batch 2 x 256; the size issue 24 measured peak memory at (several GiB for 2 ranks, minutes per mode)",
        dict(n_layer=16, n_embd=1280, n_head=16, block_size=256, batch_size=2),
        dict(n_layer=4, n_embd=1280, n_head=16, block_size=128, batch_size=2),
    ),
    "many-small": Config(
        "64 narrow blocks (width 64): many small units, where per-unit and per-parameter overhead dominates",
        dict(n_layer=64, n_embd=64, n_head=4, block_size=128, batch_size=8),
        dict(n_layer=32, n_embd=64, n_head=4, block_size=64, batch_size=4),
    ),
}
