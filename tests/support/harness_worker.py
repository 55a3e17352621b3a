"""Owns: the worker side of the multi-process harness — one spawned process that joins
the process group, then serves pickled calls (runs the function, answers with its
return value or traceback); the messages between the pytest process and its workers;
``run_subtests`` (called inside a worker); the group check run after a failure.

Knows nothing of: composable_shard; pools, time limits and errors shown to pytest
(tests/support/harness_pool.py).

Public names: ``run_subtests``. For harness_pool.py only: the messages ``_Call``,
``_Reply``, ``_WorkerSpec``, the entry point ``_worker_main`` and ``_check_group``.

See [Note: warm worker pools] and [Note: worker output] in tests/support/harness_pool.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import io
import itertools
import logging
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["run_subtests"]

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # four torch imports compete for two cores
_PARENT_POLL_S = 1.0  # how often a worker checks that the pytest process still lives
_HOST = "127.0.0.1"
_STACK_DUMP_SIGNAL = signal.SIGUSR1
_EXIT_PAYLOAD = pickle.dumps(None)  # tells a worker to leave its serve loop


# ---------------------------------------------------------------------------------------
# Messages between the pytest process and its workers (pickled with plain `pickle`, not
# multiprocessing's ForkingPickler, so tensors travel by value, not as shared memory).


class _Call(NamedTuple):
    fn: Callable[..., object]  # called as fn(rank, world_size, *args, **kwargs)
    args: tuple[object, ...]
    kwargs: dict[str, object]


class _Reply(NamedTuple):
    rank: int
    is_ok: bool  # fn returned; otherwise `error` holds the remote traceback
    value: object  # fn's return value (the worker's pid for the start-up reply)
    error: str
    is_group_alive: bool  # the default process group is still initialised after the call


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
    """Everything one worker needs to start; sent once, at spawn."""

    rank: int
    world_size: int
    backend: str
    store_port: int  # the pytest process's TCPStore, for the process group's rendezvous
    stdout_path: str  # see [Note: worker output]
    stderr_path: str
    parent_pid: int  # the worker exits when this process is gone


# ---------------------------------------------------------------------------------------
# Worker side.


def _worker_main(spec: _WorkerSpec, conn: Connection) -> None:
    """Entry point of one spawned worker: join the process group, then serve calls."""
    # Ctrl-C goes to the whole foreground process group; the pytest process handles it
    # and kills the pools, so workers must not print their own KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(spec.stdout_path, spec.stderr_path)
    faulthandler.register(_STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    _start_parent_watchdog(spec.parent_pid)
    try:
        torch.set_num_threads(1)  # up to four ranks share two cores
        with contextlib.suppress(RuntimeError):  # raises once inter-op work has started
            torch.set_num_interop_threads(1)
        _init_process_group(spec)
    except BaseException:  # noqa: BLE001 - any start-up failure is reported to the parent
        _send_reply(conn, _Reply(spec.rank, False, None, traceback.format_exc(), False))
        return
    _send_reply(conn, _Reply(spec.rank, True, os.getpid(), "", True))
    _serve(spec, conn)
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip interpreter teardown (~0.5 s of CPU per worker): nothing is left to save


def _redirect_output(stdout_path: str, stderr_path: str) -> None:
    """Point fds 1 and 2 at append-only files (see [Note: worker output])."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)  # output survives a kill


def _start_parent_watchdog(parent_pid: int) -> None:
    """Exit if the pytest process dies without shutting the pool down (e.g. SIGKILL),
    even while this worker is blocked in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _init_process_group(spec: _WorkerSpec) -> None:
    if "nccl" in spec.backend:
        torch.cuda.set_device(spec.rank)  # one device per rank, checked by the parent
    store = dist.TCPStore(
        _HOST,
        spec.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S),
    )
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size)


def _serve(spec: _WorkerSpec, conn: Connection) -> None:
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # the pytest process closed the pipe
            return
        if payload == _EXIT_PAYLOAD:
            return
        reply = _run_call(spec, payload)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        _send_reply(conn, reply)


def _reset_worker_state() -> None:
    """Undo global state that one test could leak into the next on a reused worker."""
    random.seed(0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)


def _run_call(spec: _WorkerSpec, payload: bytes) -> _Reply:
    try:
        call = pickle.loads(payload)  # imports the test module on first use
        if not isinstance(call, _Call):
            raise TypeError(f"harness worker: expected a _Call, got {type(call).__name__}")
        _reset_worker_state()
        value = call.fn(spec.rank, spec.world_size, *call.args, **call.kwargs)
    except BaseException:  # noqa: BLE001 - pytest.fail / SystemExit fail the test too
        return _Reply(spec.rank, False, None, traceback.format_exc(), dist.is_initialized())
    return _Reply(spec.rank, True, value, "", dist.is_initialized())


def _send_reply(conn: Connection, reply: _Reply) -> None:
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an unpicklable return value fails the test
        error = f"rank {reply.rank}: its return value could not be pickled:\n{traceback.format_exc()}"
        data = pickle.dumps(reply._replace(is_ok=False, value=None, error=error))
    conn.send_bytes(data)


def _check_group(rank: int, world_size: int) -> None:
    """Run on a pool after a failed call: is the process group still in step?
    The tensor lives where the backend communicates: NCCL has no CPU tensors."""
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    summed = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(summed)
    expected = world_size * (world_size + 1) / 2
    if summed.item() != expected:
        raise RuntimeError(f"rank {rank}: check all-reduce gave {summed.item()}, expected {expected}")


def run_subtests(
    cases: Mapping[str, Sequence[object]],
    fn: Callable[..., object],
    *args: object,
    **kwargs: object,
) -> None:
    """Inside a worker: call ``fn(*args, **kwargs, **case)`` for every combination of
    ``cases`` (name -> values), reseeding before each and synchronising ranks after
    each, so that many small cases share one launch. A failure names its sub-case."""
    names = list(cases)
    for values in itertools.product(*(cases[name] for name in names)):
        case = dict(zip(names, values))
        torch.manual_seed(0)
        try:
            fn(*args, **kwargs, **case)
        except Exception as exc:
            if sys.version_info >= (3, 11):
                exc.add_note(f"run_subtests: in sub-case {case}")
            else:
                logger.error("run_subtests: failed in sub-case %s", case)
            raise
        if dist.is_initialized():
            dist.barrier()
