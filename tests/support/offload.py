"""Owns: what the CPU-offload tests on CPU and on GPUs share — the step that
accumulates two micro-batches and clips, and the device of a rank.

Knows nothing of: what the tests compare (they run it through the parity
recipe).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from composable_shard import clip_grad_norm_, no_sync
from composable_shard.runtime.state import unit_states_under

from .models import lm_loss


def accumulate_and_clip(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, use_no_sync: bool = True
) -> torch.Tensor:
    """Two micro-batches (the first under no_sync for the sharded model,
    unless ``use_no_sync`` is False: then its reduced gradient is accumulated
    with the second's), then clipping to a small norm. The unsharded
    reference runs the same without no_sync."""
    half = inputs.shape[0] // 2
    sharded = any(True for _ in unit_states_under(model))
    with no_sync(model) if sharded and use_no_sync else contextlib.nullcontext():
        first = lm_loss(model(inputs[:half]), targets[:half])
        first.backward()
    second = lm_loss(model(inputs[half:]), targets[half:])
    second.backward()
    if sharded:
        clip_grad_norm_(model, 0.1)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    return ((first + second) / 2).detach()


def cuda_device(rank: int) -> torch.device:
    """This rank's GPU, made the current device."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device
