"""One rank of a job that only sets up its default group's shared memory
(files in a chosen directory) and runs one all-gather through it: what
``tests/comm/test_stale_files.py`` runs in fresh processes, killing every
rank of some jobs in the setup window (a killed rank cannot be a warm
harness worker).

``run`` is a process's target (forked from a forkserver that imported
torch once). ``pause_s`` > 0 makes every rank sleep in the setup once its
file has a name (``COMPOSABLE_SHARD_TEST_SETUP_PAUSE_S``), where the test
kills it. A rank that gets through prints ``SHARED <bool>`` (whether the
group uses shared memory), and once every rank is past the setup, ``LEFT``
and the names then in the directory, as JSON.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import transport
from composable_shard.comm.shared_memory import files, stale


def run(rank: int, world_size: int, port: int, shm_dir: str, pause_s: float, out_dir: str) -> None:
    os.environ[stale.SHM_DIR_ENV] = shm_dir
    if pause_s:
        os.environ[files.TEST_SETUP_PAUSE_ENV] = str(pause_s)
    for fd, kind in ((1, "out"), (2, "err")):
        file_fd = os.open(os.path.join(out_dir, f"rank{rank}.{kind}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    output = torch.empty(3 * world_size)
    comm.all_gather_into(output, torch.full((3,), float(rank)), None, async_op=False)
    assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(3))
    print("SHARED", transport.uses_shared_memory(None, "cpu"), flush=True)
    dist.barrier()  # every rank is past the setup
    print("LEFT", json.dumps(sorted(os.listdir(shm_dir))), flush=True)
    dist.barrier()
    dist.destroy_process_group()
