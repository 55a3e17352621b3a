"""The switch of a new checkpoint directory into place
(composable_shard/checkpoint/switch.py, manifest.py), with failures injected in-process:
the parent directory is synced right after the exchange (before the old
checkpoint is deleted); an old checkpoint that cannot be deleted (an NFS
``.nfsXXXX`` file held open) is a warning, the save succeeds and the next
save to the same path succeeds too; a failed ``renameat2`` is logged and
the two-rename path gives the same result; a failed directory fsync is an
error that says what state the checkpoint is in (a file system that cannot
sync directories is not)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import composable_shard.checkpoint.manifest as manifest
import composable_shard.checkpoint.switch as switch
from composable_shard import CheckpointError, load_checkpoint, save_checkpoint
from composable_shard.checkpoint.errors import SwitchedButNotDurable
from composable_shard.checkpoint.switch import clear_staging, switch_into_place

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, train_steps


_REAL_RMTREE = shutil.rmtree


def _directory(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "data").write_text(content)
    return path


def _undeletable(paths: Callable[[Path], bool]) -> Callable[..., Any]:
    """``shutil.rmtree`` that fails for the paths ``paths`` accepts, as it
    does on NFS while a file inside is held open (with ignore_errors, it
    leaves them)."""
    real = _REAL_RMTREE

    def rmtree(path: Any, ignore_errors: bool = False, *args: Any, **kwargs: Any) -> None:
        if paths(Path(path)):
            if ignore_errors:
                return
            raise OSError(errno.EBUSY, "Device or resource busy", os.fspath(Path(path) / ".nfs000000001"))
        real(path, ignore_errors, *args, **kwargs)

    return rmtree


def test_undeletable_old_checkpoint_is_a_warning_and_the_next_switch_succeeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, staging = tmp_path / "ckpt", tmp_path / "ckpt.partial"
    _directory(target, "old")
    _directory(staging, "new")
    monkeypatch.setattr(shutil, "rmtree", _undeletable(lambda p: p.name.startswith("ckpt.partial")))
    with pytest.warns(RuntimeWarning, match=r"new checkpoint is in place .* deleting the previous one .* failed"):
        switch_into_place(staging, target)
    assert (target / "data").read_text() == "new"
    assert (staging / "data").read_text() == "old"  # the old one, still there
    clear_staging(staging)  # the next save: moved aside, a fresh staging directory
    assert staging.is_dir() and not any(staging.iterdir())
    assert (tmp_path / "ckpt.partial.stale-1" / "data").read_text() == "old"
    (staging / "data").write_text("newer")
    with pytest.warns(RuntimeWarning):
        switch_into_place(staging, target)
    assert (target / "data").read_text() == "newer"
    monkeypatch.setattr(shutil, "rmtree", _REAL_RMTREE)  # the file was closed
    clear_staging(staging)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.partial"]


def test_parent_is_synced_right_after_the_exchange_before_the_old_checkpoint_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, staging = _directory(tmp_path / "ckpt", "old"), _directory(tmp_path / "ckpt.partial", "new")
    events: list[tuple[str, str]] = []
    real_fsync_dir, real_rmtree = switch.fsync_dir, shutil.rmtree
    monkeypatch.setattr(switch, "fsync_dir", lambda path: (events.append(("fsync", Path(path).name)), real_fsync_dir(path))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: (events.append(("rmtree", Path(path).name)), real_rmtree(path, *a, **k))[1])
    switch_into_place(staging, target)
    assert events == [("fsync", tmp_path.name), ("rmtree", "ckpt.partial")]
    assert (target / "data").read_text() == "new" and not staging.exists()


def _failing_renameat2(code: int) -> Callable[..., int]:
    def renameat2(*args: Any) -> int:
        ctypes.set_errno(code)
        return -1

    return renameat2


def test_failed_renameat2_is_logged_and_two_renames_switch_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target, staging = _directory(tmp_path / "ckpt", "old"), _directory(tmp_path / "ckpt.partial", "new")
    monkeypatch.setattr(switch, "_libc_renameat2", lambda: _failing_renameat2(errno.EINVAL))
    with caplog.at_level(logging.WARNING, logger=switch.__name__):
        switch_into_place(staging, target)
    assert "through two renames" in caplog.text and "EINVAL" in caplog.text, caplog.text
    assert (target / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failed_directory_fsync_is_an_error_saying_where_the_checkpoint_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, staging = _directory(tmp_path / "ckpt", "old"), _directory(tmp_path / "ckpt.partial", "new")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(SwitchedButNotDurable, match=r"new checkpoint is in place at .*ckpt'.*Input/output error.*save again"):
        switch_into_place(staging, target)
    assert (target / "data").read_text() == "new"
    with pytest.raises(OSError, match="Input/output error"):  # before a switch (the manifest's directory): raised as it is
        manifest.write_manifest(_directory(tmp_path / "other", "x"), {}, [], [])
    # A file system that cannot sync directories at all: nothing to lose, no error.
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EINVAL, "Invalid argument")))
    assert (staging / "data").read_text() == "old"  # kept until the next save clears it
    clear_staging(staging)
    (staging / "data").write_text("newer")
    switch_into_place(staging, target)
    assert (target / "data").read_text() == "newer"


# ----------------------------------------------------- through save_checkpoint
def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    from composable_shard import get_model_state_dict

    return get_model_state_dict(model, options=FULL)


def _save_with_failures(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    directory = Path(root) / "ckpt"
    save_checkpoint(directory, model, optimizer)
    real_rmtree, real_fsync = shutil.rmtree, os.fsync
    # Rank 0 switches: the old checkpoint cannot be deleted (NFS), twice; each save succeeds.
    if rank == 0:
        shutil.rmtree = _undeletable(lambda p: p.name.startswith("ckpt.partial"))  # type: ignore[assignment]
    try:
        for step in range(1, 3):
            train_steps(model, optimizer, range(step, step + 1))
            expected = _snapshot(model)
            with pytest.warns(RuntimeWarning) if rank == 0 else _nothing():
                save_checkpoint(directory, model, optimizer)
            train_steps(model, optimizer, range(10, 11))  # moves on
            load_checkpoint(directory, model, optimizer)
            assert_same_tensors(_snapshot(model), expected, f"model saved at step {step} despite the undeletable old one")
    finally:
        shutil.rmtree = real_rmtree  # type: ignore[assignment]
    save_checkpoint(directory, model, optimizer)  # deletable again: everything cleaned up
    assert sorted(p.name for p in Path(root).iterdir()) == ["ckpt"], sorted(Path(root).iterdir())
    # A failing fsync of the manifest's directory (before the switch): an error, the previous one intact.
    saved = _snapshot(model)
    train_steps(model, optimizer, range(20, 21))
    if rank == 0:
        os.fsync = lambda fd: real_fsync(fd) if not os.path.isdir(f"/proc/self/fd/{fd}") else _raise_eio()  # type: ignore[assignment]
    try:
        with pytest.raises(CheckpointError, match=r"cannot finish the checkpoint \(the previous one .* is intact\).*Input/output"):
            save_checkpoint(directory, model, optimizer)
    finally:
        os.fsync = real_fsync  # type: ignore[assignment]
    load_checkpoint(directory, model, optimizer)
    assert_same_tensors(_snapshot(model), saved, "the previous checkpoint after a failed fsync")
    train_steps(model, optimizer, range(21, 22))


def _raise_eio() -> None:
    raise OSError(errno.EIO, "Input/output error")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_save_succeeds_and_the_next_save_too_when_the_old_checkpoint_cannot_be_deleted(tmp_path: Path) -> None:
    run_distributed(_save_with_failures, 2, str(tmp_path))
