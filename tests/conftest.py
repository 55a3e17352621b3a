"""Owns: session-wide pytest wiring: stopping the harness's warm worker pools when the
session ends.

Knows nothing of: composable_shard; what the pools run (see ``tests/support/harness_pool.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.harness_pool import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools_at_session_end() -> Iterator[None]:
    """Pools start lazily on first use and are shared by every test; stop them once."""
    yield
    shutdown_pools()
