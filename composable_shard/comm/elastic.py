"""Owns: joining the default process group from a worker that torchrun's
elastic agent started, so that a group started again after a failure (a
new attempt) never meets the previous attempt's keys: ``init_process_group``.

Knows nothing of: collectives, models, checkpoints (``latest_checkpoint`` in
``composable_shard.checkpoint`` finds what to resume from).

Public names: ``init_process_group``, ``ATTEMPT_STORE_KEY``.

[Note: one store per attempt]
torchrun (``--rdzv-backend c10d``, torch >= 2.4) by default hosts one
TCPStore in the rank-0 agent for the whole run and points every worker's
``MASTER_ADDR:MASTER_PORT`` at it (``TORCHELASTIC_USE_AGENT_STORE=True``).
``torch.distributed.init_process_group`` with ``env://`` writes its keys
there under fixed names (each rank's address for gloo's full mesh, the
store barrier's counters), so after a restart a new worker reads the dead
attempt's addresses first and fails in gloo's ``connectFullMesh``
("Connection refused") or waits on counters that are already past
(pytorch/pytorch#135712). A prefix by ``TORCHELASTIC_RESTART_COUNT`` is not
enough: that count is each agent's own, so an agent that was replaced (a
node killed and started again) counts from 0 while the others count on,
and a restart for a node joining (``--nnodes 1:2``) does not count at all.

So every attempt gets a store of its own: rank 0 starts a TCPStore server
on a free port and announces ``"<port> <nonce>"`` in the agent's store under
``ATTEMPT_STORE_KEY``; every other rank reads the announcement, connects to
``MASTER_ADDR:<port>`` (rank 0 runs on the rank-0 agent's node, which hosts
the agent's store) and checks the server's nonce. An announcement left by
a dead attempt names a server that died with its rank 0: the connection is
refused (or the nonce differs, if the port was reused), and the rank reads
the announcement again until the new one is there, up to the group's
timeout. Nothing from an earlier attempt can reach the new group. Where the
agent does not share its store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or
no agent at all), ``MASTER_PORT`` is already new for every attempt and
``init_process_group`` is torch's ``env://`` one. Pinned by
tests/elastic/test_torchrun_restarts.py.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "ATTEMPT_STORE_KEY"]

logger = logging.getLogger(__name__)

# Where rank 0 announces its attempt's store in the agent's store.
ATTEMPT_STORE_KEY = "composable_shard/elastic/attempt_store"
_NONCE_KEY = "composable_shard/elastic/nonce"
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_CONNECT_TIMEOUT = timedelta(seconds=1)  # one try at an announced server; a dead one refuses at once
_RETRY_PAUSE_S = 0.05
_DEFAULT_TIMEOUT = timedelta(minutes=10)  # torch's default for gloo and NCCL


def init_process_group(
    backend: str | None = None,
    *,
    timeout: timedelta | None = None,
    device_id: torch.device | None = None,
) -> None:
    """Initialise the default process group from the environment torchrun
    sets, as ``torch.distributed.init_process_group(backend)`` does, but
    safe to call again in a group that torchrun's elastic agent restarted:
    each attempt rendezvouses in a store of its own (see [Note: one store
    per attempt]). ``timeout`` and ``device_id`` are torch's.

    Call it once per process, on every rank, before any other collective.
    Outside an elastic agent that shares its store it is exactly torch's
    ``env://`` initialisation."""
    if dist.is_initialized():
        raise RuntimeError(
            "composable_shard.comm.elastic.init_process_group: the default process group already exists. "
            "Call it once per process, instead of torch.distributed.init_process_group."
        )
    if os.environ.get(_AGENT_STORE_ENV) != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"composable_shard.comm.elastic.init_process_group: {_AGENT_STORE_ENV}=True but {missing} are not set. "
            "Start the script with torchrun (it sets them all)."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _attempt_store(rank, world_size, timeout or _DEFAULT_TIMEOUT)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """This attempt's own store: served by rank 0, found by the others
    through the agent's store."""
    host, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, agent_port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        own.set(_NONCE_KEY, nonce)
        agent.set(ATTEMPT_STORE_KEY, f"{own.port} {nonce}")
        logger.debug("composable_shard: rank 0 serves this attempt's store on port %d", own.port)
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        announced = agent.get(ATTEMPT_STORE_KEY).decode()  # waits for rank 0's first announcement
        served = _connect(host, announced, world_size)
        if served is not None:
            served.set_timeout(timeout)
            return served
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"composable_shard.comm.elastic.init_process_group: rank {rank} found no live store of this attempt at "
                f"{host} within {timeout} (last announcement '{announced}' in the agent's store at {host}:{agent_port}). "
                "Is rank 0 running? See its output."
            )
        time.sleep(_RETRY_PAUSE_S)


def _connect(host: str, announced: str, world_size: int) -> dist.TCPStore | None:
    """The announced server if it is alive and is the one announced (its
    nonce), else None (a dead attempt's announcement)."""
    port_text, _, nonce = announced.partition(" ")
    try:
        candidate = dist.TCPStore(
            host, int(port_text), world_size, is_master=False, timeout=_CONNECT_TIMEOUT, wait_for_workers=False
        )
        if candidate.get(_NONCE_KEY).decode() == nonce:
            return candidate
    except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        logger.debug("composable_shard: announced store '%s' not reachable (%s); reading again", announced, exc)
    return None
