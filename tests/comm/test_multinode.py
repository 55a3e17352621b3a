"""A multi-node torchrun job: two torchrun agents on 127.0.0.1 ("nodes" 0 and
1), two processes each, hybrid sharding with the shard group inside a node
and the replicate group across nodes, derived from torchrun's environment
(tests/support/multinode_job.py), in parity with a single-process reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.ports import free_ports

NODES = 2
PROCS_PER_NODE = 2
TIMEOUT_S = 240.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def _torchrun(node_rank: int, port: int, out_dir: Path, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run",  # = torchrun, with this interpreter
        "--nnodes", str(NODES),
        "--node_rank", str(node_rank),
        "--nproc_per_node", str(PROCS_PER_NODE),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port),
        str(REPO_ROOT / "tests" / "support" / "multinode_job.py"),
        str(out_dir),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_two_nodes_of_two_processes_hybrid_shard_matches_reference(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    logs = [tmp_path / f"node{node}.log" for node in range(NODES)]
    agents = [_torchrun(node, port, tmp_path, logs[node]) for node in range(NODES)]
    try:
        codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:  # only on timeout or interruption: stop what we started
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    output = "\n".join(f"---- node {node} ----\n{log.read_text(errors='replace')[-6000:]}" for node, log in enumerate(logs))
    assert codes == [0] * NODES, f"torchrun exit codes {codes}\n{output}"

    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(NODES * PROCS_PER_NODE)]
    for result in results:
        rank = result["rank"]
        node = rank // PROCS_PER_NODE
        node_ranks = list(range(node * PROCS_PER_NODE, (node + 1) * PROCS_PER_NODE))
        assert result["node"] == node, result
        assert result["shard_ranks"] == node_ranks, result
        assert result["mesh_shard_ranks"] == node_ranks, result
        assert result["replicate_ranks"] == list(range(rank % PROCS_PER_NODE, NODES * PROCS_PER_NODE, PROCS_PER_NODE))
    cases = set(results[0]["losses"])
    assert len(cases) == 2, cases
    for case in cases:
        # Every rank trained the same global batches; the losses were checked
        # against the reference on each rank, and agree everywhere.
        assert all(r["losses"][case] == results[0]["losses"][case] for r in results), case
        for node in range(NODES):
            held = [r["local_numels"][case] for r in results if r["rank"] // PROCS_PER_NODE == node]
            assert sum(held) == results[0]["full_numel"], (case, node, held)  # sharded within the node only
