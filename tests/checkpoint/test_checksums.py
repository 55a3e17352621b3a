"""Checkpoint checksums in both algorithms (see [Note: checksum algorithms]
in composable_shard/checkpoint/checksums.py): xxh3_64 where ``xxhash`` is
installed, CRC-32 otherwise. In both, a bit-flipped or truncated file is
refused with the model and optimizer unchanged; a manifest in CRC-32 (every
manifest written before xxh3_64) still verifies where ``xxhash`` is
installed; an xxh3_64 checkpoint where ``xxhash`` is missing is refused with
what to install, never loaded unverified.

The CRC-32 path is forced in-process by setting ``checksums._xxhash = None``
(restored afterwards: the harness's workers are reused)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import types
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

import composable_shard.checkpoint.checksums as files_module
from composable_shard import CheckpointError, load_checkpoint, save_checkpoint
from composable_shard.checkpoint import MANIFEST_NAME

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import assert_same_tensors, damage, make_optimizer, shard, snapshot, train_steps


def _require_xxhash() -> types.ModuleType:
    """xxhash is in the 'test' extra, so a test environment without it is
    broken: fail (with the fix) rather than skip the xxh3_64 checks."""
    try:
        import xxhash
    except ImportError as error:
        raise RuntimeError("the xxh3_64 checks need xxhash: pip install -e '.[test]' (or pip install xxhash)") from error
    return xxhash


@contextlib.contextmanager
def _without_xxhash() -> Iterator[None]:
    real = files_module._xxhash
    files_module._xxhash = None
    try:
        yield
    finally:
        files_module._xxhash = real


def _algorithm_context(algorithm: str) -> Any:
    return _without_xxhash() if algorithm == "crc32" else contextlib.nullcontext()


def _manifest_algorithms(directory: Path) -> set[str]:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    return {key for record in manifest["files"].values() for key in record if key != "bytes"}


def _setup(root: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    return model, optimizer, Path(root) / "ckpt"


def _refused_unchanged(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, match: str) -> None:
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory, model, optimizer)
    now = snapshot(model, optimizer)
    assert_same_tensors(now["model"], before["model"], f"model after refused load ({match})")
    assert_same_tensors(now["optim"], before["optim"], f"optimizer after refused load ({match})")


def _damage_is_refused_with(rank: int, world_size: int, root: str, algorithm: str) -> None:
    model, optimizer, directory = _setup(root)
    with _algorithm_context(algorithm):
        save_checkpoint(directory, model, optimizer)
        assert _manifest_algorithms(directory) == {algorithm}, _manifest_algorithms(directory)
        saved = snapshot(model, optimizer)
        train_steps(model, optimizer, range(1, 2))  # the live state moves on
        data_file = sorted(directory.glob("__*.distcp"))[-1]
        original = data_file.read_bytes()
        dist.barrier()
        damage(data_file, "flip")  # same size: only the checksum can tell
        _refused_unchanged(model, optimizer, directory, rf"file '{data_file.name}' does not match its checksum \(corrupted\)")
        if rank == 0:
            data_file.write_bytes(original)
        dist.barrier()
        damage(data_file, "truncate")
        _refused_unchanged(model, optimizer, directory, rf"file '{data_file.name}' has \d+ bytes, the manifest records")
        if rank == 0:
            data_file.write_bytes(original)
        dist.barrier()
        load_checkpoint(directory, model, optimizer)  # restored: verifies and loads the saved state
        now = snapshot(model, optimizer)
        assert_same_tensors(now["model"], saved["model"], "model after load")
        assert_same_tensors(now["optim"], saved["optim"], "optimizer after load")


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_flipped_or_truncated_file_is_refused_and_changes_nothing_in_each_algorithm(algorithm: str, tmp_path: Path) -> None:
    if algorithm == "xxh3_64":
        _require_xxhash()
    run_distributed(_damage_is_refused_with, 2, str(tmp_path), algorithm)


def _crc32_checkpoint_loads_where_xxhash_is_installed(rank: int, world_size: int, root: str) -> None:
    model, optimizer, directory = _setup(root)
    with _without_xxhash():
        save_checkpoint(directory, model, optimizer)  # a manifest as every older version wrote it
    assert files_module._xxhash is not None
    assert _manifest_algorithms(directory) == {"crc32"}
    saved = snapshot(model, optimizer)
    train_steps(model, optimizer, range(1, 2))
    data_file = sorted(directory.glob("__*.distcp"))[0]
    original = data_file.read_bytes()
    dist.barrier()
    damage(data_file, "flip")  # still checked, in crc32
    _refused_unchanged(model, optimizer, directory, rf"file '{data_file.name}' does not match its checksum")
    if rank == 0:
        data_file.write_bytes(original)
    dist.barrier()
    load_checkpoint(directory, model, optimizer)
    now = snapshot(model, optimizer)
    assert_same_tensors(now["model"], saved["model"], "model after load")
    assert_same_tensors(now["optim"], saved["optim"], "optimizer after load")


def test_crc32_manifest_still_verifies_and_loads_where_xxhash_is_installed(tmp_path: Path) -> None:
    _require_xxhash()
    run_distributed(_crc32_checkpoint_loads_where_xxhash_is_installed, 2, str(tmp_path))


def _xxh3_checkpoint_is_refused_without_xxhash(rank: int, world_size: int, root: str) -> None:
    model, optimizer, directory = _setup(root)
    save_checkpoint(directory, model, optimizer)
    assert _manifest_algorithms(directory) == {"xxh3_64"}
    train_steps(model, optimizer, range(1, 2))
    with _without_xxhash():
        _refused_unchanged(model, optimizer, directory, r"checksummed with xxh3_64 .*`pip install xxhash`")


def test_xxh3_checkpoint_without_xxhash_is_refused_naming_the_install(tmp_path: Path) -> None:
    _require_xxhash()
    run_distributed(_xxh3_checkpoint_is_refused_without_xxhash, 2, str(tmp_path))


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_file_record_hashes_every_window_of_the_mapped_file(algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests read through mmap windows equal the digest of the whole bytes,
    for a file of several windows and a partial last one, and an empty file."""
    if algorithm == "xxh3_64":
        xxhash = _require_xxhash()
        expected = lambda data: xxhash.xxh3_64_hexdigest(data)  # noqa: E731
    else:
        monkeypatch.setattr(files_module, "_xxhash", None)
        expected = zlib.crc32
    monkeypatch.setattr(files_module, "_WINDOW", mmap.ALLOCATIONGRANULARITY)
    for size in (0, 1, mmap.ALLOCATIONGRANULARITY, 3 * mmap.ALLOCATIONGRANULARITY + 7):
        path = tmp_path / f"f{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        assert files_module.file_record(path) == {"bytes": size, algorithm: expected(data)}, size
