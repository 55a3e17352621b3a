"""Random damage to each file of a small valid checkpoint (seeded byte flips
and truncations of ``.metadata``, the data file and the manifest; most
with the manifest's records rewritten to match, as whoever damaged the
files could) gives either a load of exactly what the files hold (the
stock ``FileSystemReader`` reads the same values) or a ``CheckpointError``
with the model and optimizer unchanged — never another exception, a hang
(the harness's timeout) or a changed model. See
composable_shard/checkpoint/untrusted/reader.py [Note: everything checked before the
first write]."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from composable_shard import CheckpointError, get_model_state_dict, load_checkpoint, save_checkpoint
from composable_shard.checkpoint import MANIFEST_NAME

from tests.support.harness_pool import run_distributed
from tests.support.hostile import refresh_manifest
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, snapshot, train_steps


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = shard(BufferedGPT(n_blocks=1), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    return model, optimizer


def _damage(directory: Path, rng: random.Random, world_size: int) -> str:
    """Damage one file of ``directory`` (rank 0); say how."""
    names = [".metadata", MANIFEST_NAME, *(f"__{r}_0.distcp" for r in range(world_size))]
    name = rng.choice(names)
    path = directory / name
    data = bytearray(path.read_bytes())
    if rng.random() < 0.3:
        cut = rng.randrange(len(data))
        data = data[:cut]
        how = f"{name} truncated to {cut}"
    else:
        # Mostly where the structure is (headers, pickles): the first and last KiB.
        spots = [rng.randrange(len(data)) if rng.random() < 0.3 else rng.choice([rng.randrange(min(1024, len(data))), len(data) - 1 - rng.randrange(min(1024, len(data)))]) for _ in range(rng.randint(1, 4))]
        for spot in spots:
            data[spot] ^= 1 << rng.randrange(8)
        how = f"{name} flipped at {spots}"
    path.write_bytes(bytes(data))
    if name != MANIFEST_NAME and rng.random() < 0.8:
        try:
            refresh_manifest(directory)
            how += " (manifest rewritten)"
        except Exception:  # noqa: BLE001 - the attacker could not rewrite it: the load sees the old records
            pass
    return how


def _stock_model_values(directory: Path, keys: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model values the stock reader reads from ``directory``."""
    state = {"model": {key: torch.zeros_like(value) for key, value in keys.items()}}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    return state["model"]


def _fuzz(rank: int, world_size: int, root: str, cases: int, seed: int) -> dict[str, int]:
    top = Path(root)
    base = top / "base"
    model, optimizer = _trained(seed=0)
    save_checkpoint(base, model, optimizer, extra_state={"step": 3, "note": "fuzz"})
    rng = random.Random(seed)
    tally = {"loaded": 0, "refused": 0}
    slowest = 0.0
    for case in range(cases):
        directory = top / f"case{case}"
        how = None
        if rank == 0:
            shutil.copytree(base, directory)
            how = _damage(directory, rng, world_size)
        how = [how]
        dist.broadcast_object_list(how, 0)
        fresh, fresh_optimizer = _trained(seed=1)
        before = snapshot(fresh, fresh_optimizer)
        start = time.perf_counter()
        try:
            load_checkpoint(directory, fresh, fresh_optimizer)
        except CheckpointError:
            tally["refused"] += 1
            after = snapshot(fresh, fresh_optimizer)
            assert_same_tensors(after["model"], before["model"], f"case {case} ({how[0]}): model")
            assert_same_tensors(after["optim"], before["optim"], f"case {case} ({how[0]}): optimizer")
        except Exception as exc:  # noqa: BLE001 - the finding
            raise AssertionError(f"case {case} ({how[0]}): {type(exc).__name__}: {exc}") from exc
        else:
            tally["loaded"] += 1
            loaded = {k: v for k, v in get_model_state_dict(fresh, options=FULL).items() if isinstance(v, torch.Tensor)}
            assert_same_tensors(loaded, _stock_model_values(directory, loaded), f"case {case} ({how[0]}): loaded values")
        slowest = max(slowest, time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
    assert slowest < 10.0, f"slowest load {slowest:.1f} s"
    return tally


def test_random_damage_gives_an_exact_load_or_a_checkpoint_error_with_the_model_unchanged(tmp_path: Path) -> None:
    one = run_distributed(_fuzz, 1, str(tmp_path / "one"), 240, 31, timeout=240)[0]
    two = run_distributed(_fuzz, 2, str(tmp_path / "two"), 16, 32, timeout=120)[0]
    assert one["refused"] > 50 and two["refused"] > 3, (one, two)  # the damage reached the parsers
