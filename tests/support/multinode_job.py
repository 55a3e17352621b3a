"""Owns: the worker script of the multi-node test — one rank of a torchrun job
of several "nodes" that derives its hybrid sharding groups from the
environment torchrun sets and trains in parity with a single-process
reference.

Knows nothing of: how the nodes were started (tests/comm/test_multinode.py runs
two torchrun agents on 127.0.0.1; on real machines the same script runs
under one torchrun per machine).

Run (one line per node)::

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr HOST --master_port P \\
        tests/support/multinode_job.py OUT_DIR
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr HOST --master_port P \\
        tests/support/multinode_job.py OUT_DIR

Each rank writes ``OUT_DIR/rank<R>.json``: its groups and the losses of every
sub-case. Any mismatch with the reference raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` and `composable_shard` from the checkout

from composable_shard import ShardingStrategy, fully_shard  # noqa: E402
from tests.support.models import TinyGPT  # noqa: E402
from tests.support.parity import Parity, run_parity  # noqa: E402


def node_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups from torchrun's environment: shard within a
    node (LOCAL_WORLD_SIZE consecutive ranks), replicate across nodes (the
    ranks with the same LOCAL_RANK). Every rank creates every group, in the
    same order, as ``new_group`` requires."""
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    world_size = dist.get_world_size()
    if world_size % local_world_size:
        raise ValueError(f"world size {world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}")
    rank = dist.get_rank()
    shard_group = replicate_group = None
    for node in range(world_size // local_world_size):
        ranks = list(range(node * local_world_size, (node + 1) * local_world_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            shard_group = group
    for local_rank in range(local_world_size):
        ranks = list(range(local_rank, world_size, local_world_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate_group = group
    if shard_group is None or replicate_group is None:
        raise RuntimeError(f"rank {rank} is in no shard or replicate group")
    return shard_group, replicate_group


def node_mesh():
    """The same layout as a 2-D device mesh, dims (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = dist.get_world_size() // local_world_size
    return init_device_mesh("cpu", (nodes, local_world_size), mesh_dim_names=("replicate", "shard"))


def shard_with(strategy: ShardingStrategy, **where: object):
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy, **where)
        fully_shard(model, strategy=strategy, **where)

    return shard


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shard_group, replicate_group = node_groups()
    mesh = node_mesh()
    cases = {
        "HYBRID_SHARD, process groups": shard_with(
            ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group)
        ),
        "HYBRID_SHARD_ZERO2, device mesh": shard_with(ShardingStrategy.HYBRID_SHARD_ZERO2, device_mesh=mesh),
    }
    result: dict[str, object] = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "shard_ranks": dist.get_process_group_ranks(shard_group),
        "replicate_ranks": dist.get_process_group_ranks(replicate_group),
        "mesh_shard_ranks": dist.get_process_group_ranks(mesh.get_group("shard")),
        "losses": {},
        "local_numels": {},
    }
    for name, shard in cases.items():
        models: list[nn.Module] = []

        def build() -> nn.Module:
            models.append(TinyGPT())
            return models[-1]

        parity = Parity(build=build, shard=shard)
        try:
            result["losses"][name] = run_parity(parity)  # type: ignore[index]
        except AssertionError as error:
            raise AssertionError(f"rank {rank}, {name}: {error}") from error
        # What this rank holds: its part within the node, not a quarter.
        result["local_numels"][name] = sum(p.numel() for p in models[0].parameters())  # type: ignore[index]
        result["full_numel"] = sum(p.numel() for p in TinyGPT().parameters())
        if rank == 0:
            print(
                f"{name}: shard group {result['shard_ranks']}, replicate group {result['replicate_ranks']}; "
                f"{len(result['losses'][name])} steps in parity with one process, "  # type: ignore[index]
                f"losses {[round(x, 4) for x in result['losses'][name]]}",  # type: ignore[index]
                flush=True,
            )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
