"""Simulate sharding a 7B-class Llama-style model at 8 to 1,024 ranks on one
machine: the model is built on the meta device, sharded by ``fully_shard``
under PyTorch's fake process group (collectives are no-ops, so this process
plays rank 0 of W and allocates only its own shards), and its per-rank memory
is compared with ``composable_shard.plan``.

Owns: ``bench.py scale``: the simulation and its table.
Knows nothing of: composable_shard internals (public API only).

Run::

    python scripts/bench.py scale                      # 8, 64, 256, 1024 ranks
    python scripts/bench.py scale --world-sizes 8 64 --layers 32 --plan-table
    python scripts/bench.py scale --measure-step 2     # + a real step's peak vs the plan

Columns: the plan's sharded parameters per rank and what ``fully_shard``
allocated (distinct storages behind the parameters; ``==`` when plan,
``describe`` and the allocation agree to the byte), params / W for
reference, the plan's peak for one AdamW step (model state plus the unsharded
units, gradients and buffers alive at the worst moment; no activations), the
unsharded parameters alive at that moment (the root and two blocks), and the
wall time of ``plan`` and ``fully_shard``. Parameters are left
uninitialised (``param_init_fn`` does nothing) so the time is sharding's,
not the random number generator's. At 8 ranks rank 0 holds ~3.4 GB of fp32
shards: check ``free -g`` first.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # composable_shard from a checkout

import composable_shard as cs  # noqa: E402
from composable_shard.planning.table import format_bytes  # noqa: E402


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000  # Llama-2 tokenizer
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    hidden: int = 11008  # SwiGLU width of Llama-2-7B


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _leave_uninitialised(module: nn.Module) -> None:
    """param_init_fn: storage is already allocated; skip random init."""


def _param_storage_bytes(model: nn.Module) -> int:
    storages = {}
    for param in model.parameters():
        storage = param.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(storages.values())


def simulate(cfg: LlamaConfig, world_size: int, *, show_table: bool) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            model = Llama(cfg)
        total_params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        planned = cs.plan(model, world_size=world_size, policy={TransformerBlock}, device="cpu")
        plan_s = time.perf_counter() - start
        start = time.perf_counter()
        cs.fully_shard(model, policy={TransformerBlock}, param_init_fn=_leave_uninitialised)
        shard_s = time.perf_counter() - start
        allocated = _param_storage_bytes(model)
        described = cs.describe(model)
        if show_table:
            print(planned)
        row = {
            "world_size": world_size,
            "params": total_params,
            "planned": planned.rank_bytes["params"],
            "described": described.rank_bytes["params"],
            "allocated": allocated,
            "ideal": 4 * total_params / world_size,
            "largest_unit": 4 * max(u.padded_numel for u in planned.units),
            "peak": planned.rank_bytes["total"],
            "unsharded": planned.rank_bytes["unsharded_params"],
            "plan_s": plan_s,
            "shard_s": shard_s,
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        del model, described
        gc.collect()
        return row
    finally:
        dist.destroy_process_group()


def _init_small_random(module: nn.Module) -> None:
    """param_init_fn for the measured step: finite values, cheap."""
    for param in module.parameters(recurse=False):
        if param.dim() > 1:
            param.data.normal_(0.0, 0.02)
        else:
            param.data.fill_(1.0)


def measure_step(cfg: LlamaConfig, world_size: int, seq: int) -> None:
    """One real AdamW step of rank 0 of ``world_size`` (fake process group:
    memory is real, collectives are no-ops) against the plan's peak, from the
    CPU allocator's profile."""
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            model = Llama(cfg)
        planned = cs.plan(model, world_size=world_size, policy={TransformerBlock}, device="cpu", input_shape=(1, seq))
        cs.fully_shard(model, policy={TransformerBlock}, param_init_fn=_init_small_random)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab, (1, seq))

        def step() -> None:
            model(tokens).float().sum().backward()
            optimizer.step()

        step()  # creates the optimizer state
        optimizer.zero_grad(set_to_none=True)
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        start = _param_storage_bytes(model) + sum(t.untyped_storage().nbytes() for t in state)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
        current = peak = 0
        for _, delta in events:
            current += delta
            peak = max(peak, current)
        measured = start + peak
        tensors = planned.rank_bytes["total"] - planned.rank_bytes["runtime"]  # the profiler sees tensors only
        print(
            f"measured step ({cfg.layers} layers, W={world_size}, 1x{seq} tokens): peak {format_bytes(measured)}, "
            f"plan {format_bytes(tensors)} ({tensors / measured - 1:+.1%}), "
            f"worst moment {planned.peak_moment}"
        )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--layers", type=int, default=LlamaConfig.layers)
    parser.add_argument("--plan-table", action="store_true", help="print the full plan table per world size")
    parser.add_argument(
        "--measure-step",
        type=int,
        default=0,
        metavar="LAYERS",
        help="also run one real AdamW step of a LAYERS-layer model at the largest world size and compare "
        "its CPU allocation peak with the plan (2 layers: ~2 minutes on 2 cores)",
    )
    args = parser.parse_args(argv)
    cfg = LlamaConfig(layers=args.layers)
    header = (
        f"{'W':>5}  {'plan params/rank':>16}  {'allocated':>12}  {'params*4/W':>11}  "
        f"{'plan peak (AdamW step)':>22}  {'gathered at peak':>16}  {'plan s':>6}  {'fully_shard s':>13}"
    )
    rows = []
    for world_size in args.world_sizes:
        row = simulate(cfg, world_size, show_table=args.plan_table)
        rows.append(row)
        if len(rows) == 1:
            print(
                f"Llama-style model: {row['params']:,} parameters (fp32), units: {cfg.layers} blocks + root; "
                f"largest unit {format_bytes(int(row['largest_unit']))} unsharded"
            )
            print(header)
        match = "==" if row["planned"] == row["allocated"] == row["described"] else "!="
        print(
            f"{world_size:>5}  {format_bytes(int(row['planned'])):>16}  {format_bytes(int(row['allocated'])):>9} {match}"
            f"  {format_bytes(int(row['ideal'])):>11}  {format_bytes(int(row['peak'])):>22}"
            f"  {format_bytes(int(row['unsharded'])):>16}  {row['plan_s']:>6.2f}  {row['shard_s']:>13.2f}",
            flush=True,
        )
    print(f"max RSS of this process: {format_bytes(int(max(r['max_rss'] for r in rows)))}")
    if args.measure_step:
        measure_step(LlamaConfig(layers=args.measure_step), max(args.world_sizes), seq=16)
    return 0
