"""Owns: the model every mode starts from (the example GPT at the sizes and
with the changes of ``--config``, activation checkpointing applied) and its
optimizer.

Knows nothing of: the modes' wrappers (``peers.py``), processes, timing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from gpt import GPT, GPTConfig, param_groups

from .configs import CONFIGS


def base_model(args: argparse.Namespace, device: torch.device) -> GPT:
    """The same full model on every rank and in every mode (same seed)."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config, seed=args.seed)
    customize = CONFIGS[args.config].customize
    if customize is not None:
        customize(model, args.seed)
    model = model.to(device)
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)  # before any wrapping, the same for every mode
    return model


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after wrapping: param_groups classifies by module type (trainable
    # parameters only), so wrappers and 1-D shards give the same groups.
    return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
