"""Owns: the pytest side of the multi-process harness — running one test function on N
ranks, each a warm worker process (tests/support/harness_worker.py) with a real
``torch.distributed`` process group, and turning any rank's failure or hang into one
clear error in the pytest process; the warm pools and their lifetime; the skip markers.

Knows nothing of: composable_shard (it only starts processes and ferries functions,
return values and tracebacks); what a worker does with a call (harness_worker.py).

Public names: ``run_distributed``, ``shutdown_pools``, ``DistributedTestError``,
``WORLD_SIZES``, ``world_sizes``, ``requires_cuda``, ``requires_gpus``,
``DEFAULT_TIMEOUT_S``. Tests import them from here (``tests.support.harness_pool``).

[Note: warm worker pools]
Starting torch in a spawned process costs 1-2 s of CPU, and the suite runs on two
cores, so one pool of ``world_size`` processes per (world size, backend) is started on
first use and reused by every later test until the session ends (``shutdown_pools``,
called by a session fixture in conftest.py and at interpreter exit). Each worker joins
one process group at start-up (rendezvous through a ``TCPStore`` that the pytest
process holds on a free port of 127.0.0.1) and then serves calls: it receives a pickled
``_Call``, resets the global state a test could leak (seeds, default dtype, grad mode,
thread count), runs the function and answers with a ``_Reply``. A pool is thrown away,
and restarted lazily by the next call, whenever it can no longer be trusted: a rank did
not answer in time (timeout, or hung in a collective after another rank failed), a
process died, a test destroyed the default process group, or the group failed the
all-reduce check that follows any failure (a failed test may leave collectives
unmatched).

[Note: worker output]
A worker's stdout and stderr (file descriptors 1 and 2, so C++ output too) go to two
append-only files in the pool's temporary folder; after every call the pytest process
copies what is new to its own ``sys.stdout`` / ``sys.stderr``, each line prefixed with
``[rank N]``. Inheriting the pytest process's descriptors instead would pin every
worker to whatever capture file was active when the pool started, so output would be
attributed to the wrong test. The files also receive a ``faulthandler`` stack dump when
a rank hangs, which the error message then quotes.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TextIO

import pytest
import torch
import torch.distributed as dist

from .harness_worker import (
    _EXIT_PAYLOAD,
    _HOST,
    _STACK_DUMP_SIGNAL,
    _STARTUP_TIMEOUT_S,
    _Call,
    _check_group,
    _Reply,
    _worker_main,
    _WorkerSpec,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedTestError",
    "WORLD_SIZES",
    "requires_cuda",
    "requires_gpus",
    "run_distributed",
    "shutdown_pools",
    "world_sizes",
]

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]  # must be on workers' sys.path for `tests.*`

WORLD_SIZES: tuple[int, ...] = (1, 2, 4)
world_sizes = pytest.mark.parametrize("world_size", WORLD_SIZES)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEFAULT_TIMEOUT_S = 120.0  # per call, start-up of the pool not included
_FAILURE_GRACE_S = 3.0  # after one rank failed, how long the others get to answer
_CHECK_TIMEOUT_S = 15.0  # the all-reduce check run after a failure
_STACK_DUMP_WAIT_S = 2.0  # how long to wait for hung ranks' faulthandler dumps
_SHUTDOWN_TIMEOUT_S = 5.0  # for all workers of one pool to exit when asked


def requires_gpus(count: int) -> pytest.MarkDecorator:
    """Skip marker for tests that need at least ``count`` CUDA devices (NCCL allows one
    rank per device)."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < count, reason=f"needs {count} CUDA GPU(s), found {available}")


class DistributedTestError(Exception):
    """A distributed test failed: some rank raised, died or did not finish in time.

    The message names the function, the ranks and carries every failed rank's remote
    traceback and, for unfinished ranks, their stack dumps.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_ranks: Mapping[int, str] | None = None,
        unfinished_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.failed_ranks: dict[int, str] = dict(failed_ranks or {})  # rank -> remote traceback text
        self.unfinished_ranks: tuple[int, ...] = tuple(unfinished_ranks)  # killed while still running


# ---------------------------------------------------------------------------------------
# Parent side.


class _RankOutput:
    """Copies one worker's output files to the pytest process's streams, with a prefix."""

    def __init__(self, rank: int, stdout_path: str, stderr_path: str) -> None:
        self.rank = rank
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path
        self._offsets: dict[str, int] = {stdout_path: 0, stderr_path: 0}  # bytes already read
        self._decoders: dict[str, codecs.IncrementalDecoder] = {
            path: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for path in (stdout_path, stderr_path)
        }

    def read_new(self, path: str) -> str:
        try:
            with open(path, "rb") as file:
                file.seek(self._offsets[path])
                data = file.read()
        except FileNotFoundError:  # the worker died before creating it
            return ""
        self._offsets[path] += len(data)
        return self._decoders[path].decode(data)

    def forward(self) -> None:
        _write_prefixed(sys.stdout, self.read_new(self.stdout_path), self.rank)
        _write_prefixed(sys.stderr, self.read_new(self.stderr_path), self.rank)


def _write_prefixed(stream: TextIO, text: str, rank: int) -> None:
    if not text:
        return
    prefix = f"[rank {rank}] "
    stream.write("".join(prefix + line + "\n" for line in text.splitlines()))
    stream.flush()


@dataclasses.dataclass
class _Outcome:
    """What one round of calls on a pool produced."""

    replies: dict[int, _Reply]  # ranks that answered
    exit_codes: dict[int, int | None]  # ranks whose process died without answering
    unfinished: list[int]  # ranks still running when we stopped waiting

    @property
    def failures(self) -> dict[int, str]:
        failed = {rank: reply.error for rank, reply in self.replies.items() if not reply.is_ok}
        for rank, code in self.exit_codes.items():
            failed[rank] = f"worker process died with exit code {code} before answering"
        return dict(sorted(failed.items()))

    @property
    def is_clean(self) -> bool:
        """Every rank answered, none failed, and the process group survived."""
        return (
            not self.unfinished
            and not self.exit_codes
            and all(reply.is_ok and reply.is_group_alive for reply in self.replies.values())
        )


class _WorkerPool:
    """``world_size`` warm worker processes sharing one process group (see
    [Note: warm worker pools])."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self._store: dist.TCPStore | None = None  # rendezvous of the workers' group; lives with the pool
        self._log_dir: str | None = None  # holds the workers' output files
        self._processes: list[BaseProcess] = []  # index = rank
        self._conns: list[Connection] = []  # index = rank; our end of each worker's pipe
        self._outputs: list[_RankOutput] = []  # index = rank

    @property
    def label(self) -> str:
        return f"pool(world_size={self.world_size}, backend={self.backend})"

    def is_alive(self) -> bool:
        return bool(self._processes) and all(process.is_alive() for process in self._processes)

    def start(self) -> None:
        """Spawn the workers and wait until each has joined the process group."""
        try:
            self._start()
        except BaseException:  # never leave half a pool running
            self.kill()
            raise

    def _start(self) -> None:
        began = time.monotonic()
        context = multiprocessing.get_context("spawn")  # fork is unsafe with torch's threads
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
        self._log_dir = tempfile.mkdtemp(prefix=f"composable_shard_ws{self.world_size}_")
        if str(REPO_ROOT) not in sys.path:  # spawn copies sys.path into the workers
            sys.path.insert(0, str(REPO_ROOT))
        with _worker_environment():
            for rank in range(self.world_size):
                spec = _WorkerSpec(
                    rank=rank,
                    world_size=self.world_size,
                    backend=self.backend,
                    store_port=self._store.port,
                    stdout_path=os.path.join(self._log_dir, f"rank{rank}.out"),
                    stderr_path=os.path.join(self._log_dir, f"rank{rank}.err"),
                    parent_pid=os.getpid(),
                )
                parent_conn, child_conn = context.Pipe()
                process = context.Process(
                    target=_worker_main,
                    args=(spec, child_conn),
                    name=f"composable_shard-ws{self.world_size}-rank{rank}",
                    daemon=False,  # daemonic processes may not start children (DataLoader)
                )
                process.start()
                child_conn.close()  # so that our end sees EOF when the worker dies
                self._processes.append(process)
                self._conns.append(parent_conn)
                self._outputs.append(_RankOutput(rank, spec.stdout_path, spec.stderr_path))
        outcome = self._collect(time.monotonic() + _STARTUP_TIMEOUT_S)
        self.forward_output()
        if not outcome.is_clean:
            raise DistributedTestError(
                _describe(f"starting {self.label}", self.world_size, outcome, timeout=_STARTUP_TIMEOUT_S),
                failed_ranks=outcome.failures,
                unfinished_ranks=outcome.unfinished,
            )
        logger.info("started %s in %.1f s", self.label, time.monotonic() - began)

    def run(self, payload: bytes, *, timeout: float) -> _Outcome:
        """Send one pickled ``_Call`` to every rank and gather the replies."""
        deadline = time.monotonic() + timeout
        for conn in self._conns:
            conn.send_bytes(payload)  # workers are idle in recv, so this does not block for long
        return self._collect(deadline)

    def _collect(self, deadline: float) -> _Outcome:
        """Wait for one reply per rank until ``deadline``, or until ``_FAILURE_GRACE_S``
        after the first failure (the others may be hung in a collective)."""
        outcome = _Outcome(replies={}, exit_codes={}, unfinished=[])
        pending = set(range(self.world_size))
        failed_at: float | None = None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Connection | int] = [self._conns[rank] for rank in pending]
            waitables += [self._processes[rank].sentinel for rank in pending]
            wait(waitables, timeout=remaining)
            for rank in sorted(pending):
                if self._receive(rank, outcome):
                    pending.discard(rank)
            if failed_at is None and outcome.failures:
                failed_at = time.monotonic()
        outcome.unfinished = sorted(pending)
        return outcome

    def _receive(self, rank: int, outcome: _Outcome) -> bool:
        """Take rank's reply, or note its death; False if it is still running."""
        conn, process = self._conns[rank], self._processes[rank]
        if conn.poll():  # a reply, or EOF if the worker died
            try:
                reply = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                process.join(timeout=1.0)
                outcome.exit_codes[rank] = process.exitcode
            except Exception:  # noqa: BLE001 - e.g. a return value we cannot unpickle
                error = f"rank {rank}: its reply could not be unpickled:\n{traceback.format_exc()}"
                outcome.replies[rank] = _Reply(rank, False, None, error, True)
            else:
                outcome.replies[rank] = reply
            return True
        if not process.is_alive():
            outcome.exit_codes[rank] = process.exitcode
            return True
        return False

    def forward_output(self) -> None:
        for output in self._outputs:
            output.forward()

    def dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask still-running ranks for a faulthandler dump of every thread's stack."""
        self.forward_output()  # what they printed before goes to the test's output
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                pid = self._processes[rank].pid
                if pid is not None:
                    os.kill(pid, _STACK_DUMP_SIGNAL)
        stacks: dict[int, str] = {rank: "" for rank in ranks}
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(stacks.values()):
            time.sleep(0.05)
            for rank in ranks:
                stacks[rank] += self._outputs[rank].read_new(self._outputs[rank].stderr_path)
        time.sleep(0.05)  # let a dump in progress finish
        for rank in ranks:
            stacks[rank] += self._outputs[rank].read_new(self._outputs[rank].stderr_path)
        return stacks

    def kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=_SHUTDOWN_TIMEOUT_S)
        self._release()

    def shutdown(self) -> None:
        """Ask every worker to leave its serve loop; kill those that do not."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(_EXIT_PAYLOAD)
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        for conn in self._conns:
            conn.close()
        for process in self._processes:
            with contextlib.suppress(ValueError):  # still running: could not be reaped
                process.close()
        self._processes, self._conns, self._outputs = [], [], []
        self._store = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Environment the spawned workers inherit: one OpenMP thread each, gloo on loopback."""
    overrides = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        overrides["GLOO_SOCKET_IFNAME"] = "lo"  # the host name may not resolve to loopback
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_POOLS: dict[tuple[int, str], _WorkerPool] = {}  # (world_size, backend) -> warm pool
_POOLS_LOCK = threading.RLock()  # one call at a time per session: pools are not re-entrant


def _get_pool(world_size: int, backend: str) -> _WorkerPool:
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is not None and not pool.is_alive():
        logger.warning("%s lost a worker between calls; restarting it", pool.label)
        _discard_pool(pool)
        pool = None
    if pool is None:
        pool = _WorkerPool(world_size, backend)
        pool.start()
        _POOLS[key] = pool
    return pool


def _discard_pool(pool: _WorkerPool) -> None:
    pool.kill()
    _POOLS.pop((pool.world_size, pool.backend), None)


def shutdown_pools() -> None:
    """Stop every warm pool (session end; also registered with ``atexit``)."""
    with _POOLS_LOCK:
        for pool in list(_POOLS.values()):
            pool.shutdown()
        _POOLS.clear()


atexit.register(shutdown_pools)


_CHECK_PAYLOAD = pickle.dumps(_Call(_check_group, (), {}))


def _pickle_call(fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> bytes:
    try:
        return pickle.dumps(_Call(fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run_distributed: cannot send {fn!r} and its arguments to the workers ({exc}). "
            "Pass a function defined at module level in a test module, and picklable arguments."
        ) from exc


def _check_arguments(world_size: int, timeout: float, backend: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}.")
    if timeout <= 0:
        raise ValueError(f"run_distributed: timeout must be positive, got {timeout!r} s.")
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise RuntimeError(f"run_distributed: backend {backend!r} needs CUDA; mark the test @requires_cuda.")
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"run_distributed: backend {backend!r} needs one GPU per rank, world_size={world_size} "
                f"but {torch.cuda.device_count()} GPU(s) found. Use @requires_gpus({world_size})."
            )


def run_distributed(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    **kwargs: object,
) -> list[object]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` warm worker
    processes whose default process group (``backend``) is initialised, and return the
    per-rank return values in rank order.

    ``fn`` must be a module-level function (workers import it by name) and its
    arguments and return values picklable. Before each call every worker reseeds
    ``torch`` and ``random`` with 0, sets the default dtype to float32 and enables
    grad. ``timeout`` and ``backend`` are the harness's own keywords and are not
    passed to ``fn``.

    Raises ``DistributedTestError`` if any rank raises (with every failed rank's
    remote traceback), dies, or does not finish within ``timeout`` seconds; in the
    last case, and whenever ranks were left hung after another rank failed, the pool
    is killed and the next call starts fresh workers.
    """
    _check_arguments(world_size, timeout, backend)
    payload = _pickle_call(fn, args, kwargs)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    with _POOLS_LOCK:
        pool = _get_pool(world_size, backend)
        try:
            outcome = pool.run(payload, timeout=timeout)
            stacks = pool.dump_stacks(outcome.unfinished) if outcome.unfinished else {}
            pool.forward_output()
            if not outcome.is_clean:
                _settle_pool(pool, outcome)
        except BaseException:  # Ctrl-C or a harness bug mid-call: the pool's state is unknown
            _discard_pool(pool)
            raise
    failures = outcome.failures
    if failures or outcome.unfinished:
        raise DistributedTestError(
            _describe(name, world_size, outcome, timeout=timeout, stacks=stacks),
            failed_ranks=failures,
            unfinished_ranks=outcome.unfinished,
        )
    return [outcome.replies[rank].value for rank in range(world_size)]


def _settle_pool(pool: _WorkerPool, outcome: _Outcome) -> None:
    """After a call that was not clean, keep the pool only if it is provably in step."""
    if outcome.unfinished or outcome.exit_codes:
        reason = f"ranks {outcome.unfinished or sorted(outcome.exit_codes)} did not answer"
    elif not all(reply.is_group_alive for reply in outcome.replies.values()):
        reason = "the test destroyed the default process group"
    else:
        check = pool.run(_CHECK_PAYLOAD, timeout=_CHECK_TIMEOUT_S)
        pool.forward_output()
        if check.is_clean:
            return
        reason = f"its process group failed the check after the error: {check.failures or check.unfinished}"
    logger.warning("killing %s: %s; it restarts on next use", pool.label, reason)
    _discard_pool(pool)


def _describe(
    name: str,
    world_size: int,
    outcome: _Outcome,
    *,
    timeout: float,
    stacks: Mapping[int, str] | None = None,
) -> str:
    """The message of a ``DistributedTestError``: what failed, then every traceback."""
    failures = outcome.failures
    lines: list[str] = []
    if failures:
        lines.append(f"{name} failed on rank(s) {sorted(failures)} of world_size={world_size}.")
    if outcome.unfinished:
        if failures:
            why = f"were still running {_FAILURE_GRACE_S:.0f} s after the failure (likely waiting in a collective)"
        else:
            why = f"did not finish within the {timeout:g} s timeout"
        lines.append(
            f"{name}: rank(s) {outcome.unfinished} of world_size={world_size} {why}; "
            "the worker pool was killed and restarts on next use."
        )
    for rank, error in failures.items():
        lines.append(f"\n---- rank {rank} traceback ----\n{error.rstrip()}")
    for rank, stack in (stacks or {}).items():
        lines.append(f"\n---- rank {rank} stack when killed ----\n{stack.rstrip() or '(no dump received)'}")
    return "\n".join(lines)
