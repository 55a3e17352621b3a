"""Owns: the model every mode starts from (the example GPT at the sizes and
with the changes of ``--config``, activation checkpointing applied; on the
meta device for configurations with ``deferred_init``), the initialisation
that materialises such a model module by module, and its optimizer.

Knows nothing of: the modes' wrappers (``peers.py``), processes, timing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from gpt import GPT, GPTConfig, param_groups

from .configs import CONFIGS


def is_deferred(args: argparse.Namespace) -> bool:
    return CONFIGS[args.config].deferred_init


def base_model(args: argparse.Namespace, device: torch.device) -> GPT:
    """The same full model on every rank and in every mode (same seed); on
    the meta device, uninitialised, with ``deferred_init`` (the mode
    materialises it with ``init_module``)."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    if is_deferred(args):
        torch.manual_seed(args.seed)  # init_module's draws: the same on every rank
        with torch.device("meta"):
            model = GPT(config, seed=args.seed)
    else:
        model = GPT(config, seed=args.seed)
    customize = CONFIGS[args.config].customize
    if customize is not None:
        customize(model, args.seed)
    if not is_deferred(args):
        model = model.to(device)
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)  # before any wrapping, the same for every mode
    return model


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after wrapping: param_groups classifies by module type (trainable
    # parameters only), so wrappers and 1-D shards give the same groups.
    if getattr(args, "optimizer_in_backward", False):
        return StepsInBackward(model, args)  # type: ignore[return-value]
    if getattr(args, "optimizer", "adamw") == "muon":
        return MuonAndAdamW(model, args)  # type: ignore[return-value]
    return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))


class MuonAndAdamW:
    """``--optimizer muon``: torch's Muon on every block's 2-D weight (built
    while they are 2-D: before composable_shard shards them, FSDP2's DTensors
    and DDP's whole tensors are 2-D anyway), AdamW with the usual groups on
    the rest; stepped one after the other, as torchtitan's optimizer
    container does."""

    def __init__(self, model: nn.Module, args: argparse.Namespace) -> None:
        matrices = [p for name, p in model.named_parameters() if "blocks." in name and p.ndim == 2]
        chosen = {id(p) for p in matrices}
        groups = [
            {**group, "params": [p for p in group["params"] if id(p) not in chosen]}
            for group in param_groups(model, args.weight_decay)
        ]
        self.muon = torch.optim.Muon(matrices, lr=args.lr * 10, weight_decay=args.weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95))
        self.optimizers = (self.muon, self.adamw)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class StepsInBackward:
    """``--optimizer-in-backward``: one AdamW per parameter (the groups'
    settings), stepped as soon as the parameter's gradient is final, which
    is then set to None; the loop's ``step`` and ``zero_grad`` have nothing
    left to do. composable_shard and FSDP2 run post-accumulate-grad hooks on
    the parameters after their reduction; FSDP1 (``use_orig_params``) steps
    the optimizers it finds in ``_in_backward_optimizers`` after its
    reduce-scatter, its documented path (``_apply_optimizer_in_backward``
    with ``register_hook=False``: its parameters are views autograd never
    sees); an unwrapped model's hooks fire as autograd accumulates."""

    def __init__(self, model: nn.Module, args: argparse.Namespace) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.optim import _apply_optimizer_in_backward

        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        fsdp1 = isinstance(model, FullyShardedDataParallel)
        for group in param_groups(model, args.weight_decay):
            settings = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": group["weight_decay"]}
            for param in group["params"]:
                if fsdp1:
                    _apply_optimizer_in_backward(torch.optim.AdamW, [param], settings, register_hook=False)
                    self.optimizers[param] = param._in_backward_optimizers[-1]
                else:
                    self.optimizers[param] = torch.optim.AdamW([param], **settings)
                    param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]  # type: ignore[index]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


@torch.no_grad()
def init_module(module: nn.Module, device: torch.device | None = None) -> None:
    """Initialise ``module``'s own parameters as ``GPT`` does (normal(0,
    0.02) weights, zero biases, unit norms; the residual projections' smaller
    std is left out), giving meta parameters storage on ``device`` first (the
    example GPT has no buffers). The
    ``param_init_fn`` of composable_shard (called after the module's tensors
    got storage) and of FSDP1 (called on every module of a unit, still on
    meta), and FSDP2's init after ``to_empty``, in a DTensor's local shard.
    Drawn from the global generator: every rank draws the same values for
    the modules it initialises whole."""
    for param in module.parameters(recurse=False):
        if param.is_meta and device is not None:
            # In place (same Parameter object), so a tied weight stays tied
            # (to_empty would give the lm_head its own copy of tok_emb's).
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        _local(module.weight).normal_(0.0, 0.02)
    elif isinstance(module, nn.LayerNorm) and module.weight is not None:
        _local(module.weight).fill_(1.0)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        _local(bias).zero_()
