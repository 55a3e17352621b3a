"""A GPT trained with tensor parallelism inside each block and fully_shard
across blocks, on a 2 x 2 (dp, tp) mesh of 4 CPU processes (gloo).

Run::

    torchrun --nproc_per_node 4 examples/tensor_parallel_gpt.py [--steps 5]

Each block's attention splits its heads over "tp" (q, k, v ColwiseParallel,
the output projection RowwiseParallel) and so does its MLP (up Colwise, down
Rowwise); ``fully_shard(block, device_mesh=mesh["dp"])`` then shards every
block's local tensor-parallel shards over "dp". The embeddings, norms and
head stay plain tensors, sharded over "dp" by the root unit. Rank 0 prints
the loss, which equals one process training on the global batch
(tests/tensor_parallel/test_tp_recipe.py checks it step by step).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from composable_shard import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No key bias: softmax ignores it (its gradient is round-off only).
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # -1 heads: this tp rank's share of them (all of them in one process).
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "q": ColwiseParallel(),
    "k": ColwiseParallel(),
    "v": ColwiseParallel(),
    "o": RowwiseParallel(),
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
}


def parallelize_and_shard(model: GPT, mesh: DeviceMesh) -> GPT:
    """The recipe: TP inside each block on "tp", then fully_shard per block
    (and the root) on "dp"."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, device_mesh=mesh["dp"])
    fully_shard(model, device_mesh=mesh["dp"])
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """DTensor (tensor-parallel) and plain parameters in separate groups:
    optimizers' foreach and fused kernels take one group's tensors at once,
    and DTensor refuses a list that mixes both."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]


def batch(step: int, global_batch: int = 8, seq: int = 16, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (global_batch, seq + 1), generator=torch.Generator().manual_seed(step))


def local_rows(tokens: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This dp rank's rows; every tp rank of it sees the same ones."""
    return tokens.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]


def backward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss on ``tokens``, backpropagated; returns it detached."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = backward(model, tokens)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = parallelize_and_shard(GPT(), mesh)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=True)
    for step in range(args.steps):
        # One batch over and over, so the printed loss visibly falls.
        loss = train_step(model, optimizer, local_rows(batch(0), mesh))
        dist.all_reduce(loss)  # every rank's mean; tp ranks hold the same one
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item() / dist.get_world_size():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and "RANK" in os.environ:
    main()
