"""``composable_shard.comm.elastic.init_process_group``: each attempt's own
store, found through the agent's store past a dead attempt's announcement
(real TCPStores; the agent's store is one this test serves), and its
refusals: called twice (the group still works), torchrun's variables
missing, no live store within the timeout. The restarts themselves:
test_torchrun_restarts.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from composable_shard.comm import elastic

from tests.support.harness_pool import run_distributed
from tests.support.ports import free_ports


@pytest.fixture
def agent_store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    """A store standing in for the agent's, with a dead attempt's announcement."""
    agent_port, dead_port = free_ports(2)
    store = dist.TCPStore("127.0.0.1", agent_port, 2, is_master=True, wait_for_workers=False)
    store.set(elastic.ATTEMPT_STORE_KEY, f"{dead_port} {'0' * 32}")  # nobody listens there any more
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    return store


def test_a_rank_passes_over_the_dead_attempts_store_to_rank_0s_new_one(agent_store: dist.TCPStore) -> None:
    found: dict[int, dist.Store] = {}

    def join(rank: int) -> None:
        found[rank] = elastic._attempt_store(rank, 2, timedelta(seconds=30))

    rank1 = threading.Thread(target=join, args=(1,))
    rank1.start()
    time.sleep(1.5)  # rank 1 reads the stale announcement, is refused, reads again
    join(0)
    rank1.join(timeout=30)
    assert set(found) == {0, 1}
    found[0].set("written by rank 0", "of this attempt")
    assert found[1].get("written by rank 0") == b"of this attempt"
    assert agent_store.get(elastic.ATTEMPT_STORE_KEY).split()[0] == str(found[0].port).encode()


def test_no_live_store_within_the_timeout_is_an_error_naming_it(agent_store: dist.TCPStore) -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 found no live store of this attempt at 127\.0\.0\.1 within 0:00:02 "
                                           r"\(last announcement '\d+ 0{32}' .*Is rank 0 running\? See its output\."):
        elastic._attempt_store(1, 2, timedelta(seconds=2))


def test_missing_torchrun_variables_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"TORCHELASTIC_USE_AGENT_STORE=True but \['RANK', 'WORLD_SIZE', 'MASTER_ADDR', "
                                           r"'MASTER_PORT'\] are not set\. Start the script with torchrun"):
        elastic.init_process_group("gloo")
    assert not dist.is_initialized()


def _called_twice(rank: int, world_size: int) -> float:
    try:
        elastic.init_process_group("gloo")
    except RuntimeError as exc:
        assert "the default process group already exists. Call it once per process" in str(exc), exc
    else:
        raise AssertionError("a second init_process_group was not refused")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the group is untouched
    return total.item()


def test_calling_it_in_an_initialised_process_is_refused_and_the_group_works() -> None:
    assert run_distributed(_called_twice, 2) == [3.0, 3.0]
