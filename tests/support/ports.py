"""Owns: free TCP ports of 127.0.0.1 for the process groups that tests
start themselves (fault jobs, torchrun), as opposed to the warm harness.

Knows nothing of: process groups or jobs.

Ports come from below the kernel's ephemeral range. A port found by binding
to port 0 is an ephemeral one: between closing it and the job's store
binding it again, any ``connect`` on the machine may get it as its local
port, and the store then fails with EADDRINUSE. That happened with eleven
fault jobs starting at once (torch 2.9.1, ``test_comm_failures``). The
kernel never hands out a port below its range to a ``connect``.
"""

from __future__ import annotations

import os
import random
import socket

_DEFAULT_EPHEMERAL_LOW = 32768
_SPAN = 12000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of 127.0.0.1 that were free a moment ago,
    all below the ephemeral range (in a random order per process, so that
    two test runs at once rarely try the same ones)."""
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - _SPAN), low))
    random.Random(os.getpid()).shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"fewer than {count} free ports of 127.0.0.1 below {low}")
