"""One rank of a small training job (TinyGPT, FULL_SHARD, parity against
the single-process reference) whose rank 1 can die or stop at a chosen
point: what ``tests/comm/test_failures.py`` runs in fresh processes, since a
killed rank cannot be a warm harness worker.

Run: python -m tests.support.fault_job RANK WORLD_SIZE PORT FAULT TIMEOUT_S, or
``run`` as a process's target (the tests fork it from a forkserver that
imported torch once).
FAULT: ``none``; ``setup`` (rank 1 dies while the group sets up its
transport: in the shared-memory setup, after creating its file, or at the
group's first collective through gloo); ``forward`` (rank 1 dies instead of
issuing the second all-gather of step 2's forward); ``backward`` (instead of
issuing step 2's first gradient reduction); ``stop`` (rank 1 stops, alive,
at the forward point: only the group's timeout can end the wait);
``all_reduce`` (shared memory only: the model NO_SHARD, so its gradients
are all-reduced, in one bucket; rank 1 dies instead of issuing step 2's
first all-reduce); ``all_to_all`` (shared memory only: the optimizer steps
whole parameters on their owners, ``NewtonSchulzSGD``; rank 1 dies instead
of issuing step 2's first all-to-all, ``comm.all_to_all_pieces``, which
sends the gradients to their owners); ``publish`` (shared memory only:
rank 1 dies instead of publishing step 2's shards, ``PublishedShards.publish``,
at the root's forward); ``close`` (shared memory only: rank 1 dies at the
end of step 2's backward instead of closing its publish,
``PublishedShards.close``, where rank 0 waits for it before its shards may
change); ``stream`` (shared memory only: slots of 256 bytes, so every collective streams
in rounds; rank 1 dies in step 2 in the middle of the first collective of
more than ``SLOTS + 1`` rounds, after publishing ``SLOTS + 1`` of them).
The transport is chosen by ``COMPOSABLE_SHARD_SHARED_MEMORY`` as for users.

Prints ``FAULT_AT <unix time>`` (rank 1, just before the fault) and, where a
collective fails, ``ERROR_AT <unix time>`` and ``ERROR <message>`` (rank 0),
then lets the exception end the process as it would a user's.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from composable_shard import ShardingStrategy, comm
from composable_shard.comm import shared_memory
from composable_shard.comm.shared_memory import SLOTS, HostSharedMemory, PublishedShards

from .models import TinyGPT
from .optimizers import NewtonSchulzSGD
from .parity import Parity, plain_step, run_parity, shard_manually

_STEP = [-1]  # the step this rank is in


def _fault(how: str) -> None:
    print(f"FAULT_AT {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def _arm(fault: str) -> None:
    """Make rank 1 die (or stop) at the fault's point."""
    calls = {"all_gather_into": 0, "reduce_scatter": 0, "all_reduce": 0, "all_to_all": 0, "publish": 0, "close": 0}

    def at(name: str, index: int, step: int, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _STEP[0] == step:
                calls[name] += 1
                if calls[name] == index:
                    _fault(fault)
            return real(*args, **kwargs)

        return call

    def outermost(name: str, index: int, step: int, names: tuple[str, ...]) -> None:
        """Count, as ``name``, the calls of ``names`` the runtime makes (a
        unit's own collective or a bucket's, one each, whichever way the
        transport moves it: through shared memory a bucket moves in place,
        without the single-tensor collective; through gloo it calls it)."""
        inside = [False]

        def counting(real: Callable[..., Any]) -> Callable[..., Any]:
            counted = at(name, index, step, real)

            def call(*args: Any, **kwargs: Any) -> Any:
                if inside[0]:
                    return real(*args, **kwargs)
                inside[0] = True
                try:
                    return counted(*args, **kwargs)
                finally:
                    inside[0] = False

            return call

        for each in names:
            setattr(comm, each, counting(getattr(comm, each)))

    if fault in ("forward", "stop"):
        # The second all-gather the runtime issues in step 1.
        outermost("all_gather_into", 2, 1, ("all_gather_into", "all_gather_together"))
    elif fault == "backward":
        # The first gradient reduction the runtime issues in step 1.
        outermost("reduce_scatter", 1, 1, ("reduce_scatter", "reduce_grads_together"))
    elif fault == "all_reduce":
        outermost("all_reduce", 1, 1, ("all_reduce", "reduce_grads_together"))
    elif fault == "all_to_all":
        # Through shared memory the owner step exchanges in place ([Note: the
        # exchange in place] in composable_shard/optim/owner_step.py).
        comm.all_to_all_pieces = at("all_to_all", 1, 1, comm.all_to_all_pieces)
    elif fault == "publish":
        PublishedShards.publish = at("publish", 1, 1, PublishedShards.publish)  # type: ignore[method-assign]
    elif fault == "close":
        PublishedShards.close = at("close", 1, 1, PublishedShards.close)  # type: ignore[method-assign]
    elif fault == "stream":
        real_stream = HostSharedMemory._stream

        def stream(self: HostSharedMemory, what: str, signature: int, rounds: list, write: Any, *args: Any, **kwargs: Any) -> Any:
            if _STEP[0] != 1 or len(rounds) <= SLOTS + 1 or calls["all_gather_into"]:
                return real_stream(self, what, signature, rounds, write, *args, **kwargs)
            calls["all_gather_into"] = 1  # armed once
            written = [0]

            def write_then_die(*round_args: Any) -> None:
                written[0] += 1
                if written[0] == SLOTS + 2:
                    _fault(fault)
                write(*round_args)

            return real_stream(self, what, signature, rounds, write_then_die, *args, **kwargs)

        HostSharedMemory._stream = stream  # type: ignore[method-assign]
    elif fault == "setup":
        if os.environ.get("COMPOSABLE_SHARD_SHARED_MEMORY", "1") == "0":
            comm.all_gather_into = at("all_gather_into", 1, 0, comm.all_gather_into)
        else:
            real_fallocate = os.posix_fallocate

            def fallocate(*args: Any) -> None:
                _fault(fault)  # the file exists; its space is not reserved yet
                real_fallocate(*args)

            os.posix_fallocate = fallocate


def _counting_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    _STEP[0] += 1
    return plain_step(model, inputs, targets)


def run(rank: int, world_size: int, port: int, fault: str, timeout_s: float, switch: str, out_dir: str) -> None:
    """``main`` in a forked process: the transport switch set, its output in
    ``out_dir/rank{rank}.out`` and ``.err``."""
    os.environ["COMPOSABLE_SHARD_SHARED_MEMORY"] = switch
    for fd, kind in ((1, "out"), (2, "err")):
        file_fd = os.open(os.path.join(out_dir, f"rank{rank}.{kind}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    main(rank, world_size, port, fault, timeout_s)


def main(rank: int, world_size: int, port: int, fault: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    if fault == "stream":
        shared_memory.SLOT_BYTES = 256  # on every rank: the group takes rank 0's
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if rank == 1 and fault != "none":
        _arm(fault)
    strategy = ShardingStrategy.NO_SHARD if fault == "all_reduce" else ShardingStrategy.FULL_SHARD
    parity = Parity(build=TinyGPT, shard=shard_manually(strategy), steps=2, step_fn=_counting_step)
    if fault == "all_to_all":  # stepped whole, on owners: the owner step's all-to-all runs
        parity = dataclasses.replace(parity, make_optimizer=lambda model: NewtonSchulzSGD(model.parameters()))
    try:
        run_parity(parity)
    except Exception as error:
        print(f"ERROR_AT {time.time():.6f}", file=sys.stderr, flush=True)
        print(f"ERROR {type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr, flush=True)
        raise
    print("TRAINED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world_size, port, fault, timeout_s = sys.argv[1:6]
    main(int(rank), int(world_size), int(port), fault, float(timeout_s))
