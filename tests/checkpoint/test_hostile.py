"""Loading is safe against any bytes (composable_shard/checkpoint/untrusted/safe_files.py,
metadata_checks.py, pickle_bounds.py, reader.py [Note: everything checked
before the first write]): each hostile directory below is built from a small
valid checkpoint and refused with a ``CheckpointError`` naming the file and
item — within a time bound, with no file outside the directory read (a
canary checkpoint with distinctive values), no code run (a marker file) —
and the model and optimizer bit-identical on every rank afterwards, at 2
ranks (and 1 for a few); a symbolic link that stays inside the directory
still loads exactly. Plain ``dcp.load`` through ``DirectFileSystemReader``,
``verify_checkpoint``, the converters and their command line refuse the
same directories, saved by 1 and by 2 ranks, with no process group, and
write no file anywhere."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from composable_shard import CheckpointError, load_checkpoint, save_checkpoint
from composable_shard.checkpoint import MANIFEST_NAME, DirectFileSystemReader, dcp_to_safetensors, dcp_to_torch_save, verify_checkpoint
from composable_shard.checkpoint.refusals import refusal_before_writing

from tests.support.harness_pool import run_distributed
from tests.support.hostile import (
    dag_pickle,
    edit_metadata,
    first_matrix_item,
    read_metadata,
    refresh_manifest,
    replace_item,
    saved,
    zip_with_data_pickle,
)
from tests.support.models import BufferedGPT
from tests.support.state_dicts import assert_same_tensors, make_optimizer, shard, snapshot, train_steps

REPO = Path(__file__).resolve().parents[2]
TIME_BOUND_S = 10.0
# Far below what the hostile cases claim (512 MiB) and far above a refused
# load of this tiny model (a few MiB).
MEMORY_BOUND_MIB = 64


class CodePayload:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return exec, (f"open({self.marker!r}, 'w').close()",)


# ------------------------------------------------------------- mutations
def _dotdot(d: Path, canary: Path) -> None:
    rel = os.path.relpath(canary / "__0_0.distcp", d)
    edit_metadata(d, lambda md: [setattr(info, "relative_path", rel) for info in md.storage_data.values() if info.relative_path == "__0_0.distcp"])


def _absolute(d: Path, canary: Path) -> None:
    target = str(canary / "__0_0.distcp")
    edit_metadata(d, lambda md: [setattr(info, "relative_path", target) for info in md.storage_data.values() if info.relative_path == "__0_0.distcp"])


def _link_outside(d: Path, canary: Path) -> None:
    (d / "__0_0.distcp").unlink()
    shutil.copy(d.parent / "base" / "__0_0.distcp", d.parent / "outside.distcp")  # same bytes, outside the directory
    os.symlink(d.parent / "outside.distcp", d / "__0_0.distcp")
    refresh_manifest(d)


def _manifest_outside(d: Path, canary: Path) -> None:
    refresh_manifest(d, {"files": {**__import__("json").loads((d / MANIFEST_NAME).read_text())["files"], "../canary/.metadata": {"bytes": 1, "crc32": 0}}})


def _fifo_item(d: Path, canary: Path) -> None:
    last = sorted(d.glob("__*_0.distcp"))[-1]
    last.unlink()
    os.mkfifo(last)


def _fifo_metadata(d: Path, canary: Path) -> None:
    (d / MANIFEST_NAME).unlink()
    (d / ".metadata").unlink()
    os.mkfifo(d / ".metadata")


def _claimed_beyond_file(d: Path, canary: Path) -> None:
    def edit(md: Any) -> None:
        index, info = first_matrix_item(md)
        info.length = 512 << 20

    edit_metadata(d, edit)


def _chunks(how: str) -> Callable[[Path, Path], None]:
    def mutate(d: Path, canary: Path) -> None:
        def edit(md: Any) -> None:
            index, _ = first_matrix_item(md)
            tensor_md = md.state_dict_metadata[index.fqn]
            if how == "empty":
                tensor_md.chunks = []
            elif how == "half":
                chunk = tensor_md.chunks[0]
                tensor_md.chunks[0] = ChunkStorageMetadata(chunk.offsets, torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]]))
            else:  # the same total, one chunk moved onto another (and its storage re-keyed)
                chunk = tensor_md.chunks[-1]
                moved = torch.Size([max(chunk.offsets[0] - 1, 0), *chunk.offsets[1:]]) if chunk.offsets[0] else torch.Size([1, *chunk.offsets[1:]])
                tensor_md.chunks[-1] = ChunkStorageMetadata(moved, chunk.sizes if chunk.offsets[0] else torch.Size([chunk.sizes[0] - 1, *chunk.sizes[1:]]))
                old = MetadataIndex(index.fqn, chunk.offsets)
                md.storage_data[MetadataIndex(index.fqn, moved)] = md.storage_data.pop(old)

        edit_metadata(d, edit)

    return mutate


def _item(make: Callable[[torch.Tensor, Path], bytes]) -> Callable[[Path, Path], None]:
    def mutate(d: Path, canary: Path) -> None:
        index, _ = first_matrix_item(read_metadata(d))
        replace_item(d, index, lambda tensor: make(tensor, d))

    return mutate


def _optimizer_chunk_half(d: Path, canary: Path) -> None:
    def edit(md: Any) -> None:
        fqn = next(k for k, v in md.state_dict_metadata.items() if k.startswith("optim.state.") and k.endswith("exp_avg") and len(getattr(v, "size", ())) == 2)
        chunk = md.state_dict_metadata[fqn].chunks[0]
        md.state_dict_metadata[fqn].chunks[0] = ChunkStorageMetadata(chunk.offsets, torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]]))

    edit_metadata(d, edit)


def _dag_object_item(d: Path, canary: Path) -> None:
    replace_item(d, MetadataIndex("extra.step"), lambda value: zip_with_data_pickle(saved(value), dag_pickle(48)))


def _negative_offset(d: Path, canary: Path) -> None:
    def edit(md: Any) -> None:
        first_matrix_item(md)[1].offset = -1

    edit_metadata(d, edit)


def _dag_metadata(d: Path, canary: Path) -> None:
    (d / ".metadata").write_bytes(dag_pickle(48))
    refresh_manifest(d)


def _malformed_metadata(d: Path, canary: Path) -> None:
    edit_metadata(d, lambda md: setattr(first_matrix_item(md)[1], "relative_path", 5))


def _malformed_manifest(d: Path, canary: Path) -> None:
    (d / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)


# name -> (mutation, what the error says)
CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "relative path with ..": (_dotdot, "leads outside the checkpoint directory"),
    "absolute relative path": (_absolute, "leads outside the checkpoint directory"),
    "symbolic link leading out": (_link_outside, "outside the checkpoint directory"),
    "manifest entry outside": (_manifest_outside, "leads outside the checkpoint directory"),
    "FIFO item": (_fifo_item, "not a regular file"),
    "FIFO .metadata": (_fifo_metadata, "not a regular file"),
    "length beyond the file": (_claimed_beyond_file, "claims bytes"),
    "empty chunk list": (_chunks("empty"), "do not cover"),
    "half chunk": (_chunks("half"), "do not cover"),
    "overlapping chunks": (_chunks("overlap"), "do not cover"),
    "stored shape differs": (_item(lambda t, d: saved(t.reshape(-1))), "the metadata says"),
    "legacy item with a payload": (_item(lambda t, d: saved({"t": t, "p": CodePayload(str(d) + ".marker")}, legacy=True)), "refused"),
    "zero-filled item": (_item(lambda t, d: bytes(len(saved(t)))), "malformed"),
    "stride 0": (_item(lambda t, d: saved(torch.zeros(()).expand(t.shape))), "stride of 0"),
    "DAG in a tensor item's data.pkl": (_item(lambda t, d: zip_with_data_pickle(saved(t), dag_pickle(48))), "DAG bomb"),
    "negative offset": (_negative_offset, "malformed byte range"),
    "optimizer state half chunk": (_optimizer_chunk_half, "do not cover"),
    "DAG in an object item": (_dag_object_item, "DAG bomb"),
    "DAG bomb .metadata": (_dag_metadata, "DAG bomb"),
    "malformed metadata": (_malformed_metadata, "not a file name"),
    "deeply nested manifest": (_malformed_manifest, "unreadable"),
}
ONE_RANK = ["relative path with ..", "FIFO item", "half chunk", "legacy item with a payload", "DAG bomb .metadata"]


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = shard(BufferedGPT(n_blocks=1), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    return model, optimizer


def _start_peak_rss() -> float:
    """Reset this process's resident-set high-water mark (VmHWM) to its
    resident set now (Linux: ``/proc/self/clear_refs``) and return that, in
    MiB: the growth read back by ``_peak_rss_growth_mib`` is this
    operation's, even in a warm worker whose earlier peak was higher."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _peak_rss_growth_mib(start: float) -> float:
    return _status_mib("VmHWM") - start


def _status_mib(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _every_case_is_refused(rank: int, world_size: int, root: str, names: list[str]) -> dict[str, str]:
    top = Path(root)
    base, canary = top / "base", top / "canary"
    model, optimizer = _trained(seed=0)
    save_checkpoint(base, model, optimizer, extra_state={"step": 1})
    canary_model, canary_optimizer = _trained(seed=7)
    with torch.no_grad():
        for param in canary_model.parameters():
            param.fill_(1234.5)  # distinctive: a model holding it read the canary
    save_checkpoint(canary, canary_model, canary_optimizer)
    outcomes: dict[str, str] = {}
    for name in names:
        mutate, expected = CASES[name]
        directory = top / name.replace(" ", "_").replace(".", "")
        if rank == 0:
            shutil.copytree(base, directory, symlinks=True)
            mutate(directory, canary)
        dist.barrier()
        fresh, fresh_optimizer = _trained(seed=1)
        before = snapshot(fresh, fresh_optimizer)
        rss = _start_peak_rss()
        start = time.perf_counter()
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(directory, fresh, fresh_optimizer)
        took = time.perf_counter() - start
        growth = _peak_rss_growth_mib(rss)
        assert growth < MEMORY_BOUND_MIB, f"{name}: peak RSS grew by {growth:.0f} MiB ({refused.value})"
        message = str(refused.value)
        assert expected in message, f"{name}: {message}"
        assert took < TIME_BOUND_S, f"{name}: took {took:.1f} s"
        assert not os.path.exists(str(directory) + ".marker"), f"{name}: the payload ran"
        after = snapshot(fresh, fresh_optimizer)
        assert_same_tensors(after["model"], before["model"], f"{name}: model")
        assert_same_tensors(after["optim"], before["optim"], f"{name}: optimizer")
        outcomes[name] = f"{type(refused.value).__name__}: {message}"
        dist.barrier()
    return outcomes


@pytest.mark.parametrize("world_size", [1, 2])
def test_hostile_directories_are_refused_with_the_model_unchanged_on_every_rank(world_size: int, tmp_path: Path) -> None:
    names = list(CASES) if world_size == 2 else ONE_RANK
    per_rank = run_distributed(_every_case_is_refused, world_size, str(tmp_path), names, timeout=300)
    for name in names:
        messages = {outcomes[name] for outcomes in per_rank}
        assert len(messages) == 1, f"{name}: the ranks raised different errors: {messages}"


def _link_inside_loads(rank: int, world_size: int, root: str) -> None:
    directory = Path(root) / "linked"
    model, optimizer = _trained(seed=0)
    save_checkpoint(directory, model, optimizer)
    if rank == 0:  # a Hugging Face cache's layout: the file is a link to a blob in the same directory
        (directory / "blobs").mkdir()
        os.replace(directory / "__0_0.distcp", directory / "blobs" / "0")
        os.symlink(Path("blobs") / "0", directory / "__0_0.distcp")
    dist.barrier()
    fresh, fresh_optimizer = _trained(seed=1)
    load_checkpoint(directory, fresh, fresh_optimizer)
    expected, loaded = snapshot(model, optimizer), snapshot(fresh, fresh_optimizer)
    assert_same_tensors(loaded["model"], expected["model"], "linked: model")
    assert_same_tensors(loaded["optim"], expected["optim"], "linked: optimizer")
    # A link leading out is refused, and admitted with the keyword.
    outside = Path(root) / "outside_blob"
    if rank == 0:
        os.replace(directory / "blobs" / "0", outside)
        (directory / "__0_0.distcp").unlink()
        os.symlink(outside, directory / "__0_0.distcp")
    dist.barrier()
    with pytest.raises(CheckpointError, match="allow_links_outside"):
        load_checkpoint(directory, fresh, fresh_optimizer)
    fresh2, fresh2_optimizer = _trained(seed=2)
    load_checkpoint(directory, fresh2, fresh2_optimizer, allow_links_outside=True)
    assert_same_tensors(snapshot(fresh2, fresh2_optimizer)["model"], expected["model"], "link admitted: model")
    # Even admitted, a link to a device is not a regular file: refused
    # without a read, quickly, and without the 512 MiB it claims to hold.
    if rank == 0:
        (directory / "__0_0.distcp").unlink()
        os.symlink("/dev/zero", directory / "__0_0.distcp")
        (directory / MANIFEST_NAME).unlink()  # nothing to check it against: the reader meets it
        edit_metadata(directory, lambda md: [setattr(info, "length", 512 << 20) for info in md.storage_data.values() if info.relative_path == "__0_0.distcp"])
    dist.barrier()
    before = snapshot(fresh2, fresh2_optimizer)
    rss = _start_peak_rss()
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(directory, fresh2, fresh2_optimizer, allow_links_outside=True)
    assert _peak_rss_growth_mib(rss) < MEMORY_BOUND_MIB, f"peak RSS grew by {_peak_rss_growth_mib(rss):.0f} MiB ({refused.value})"
    assert time.perf_counter() - start < TIME_BOUND_S
    assert "not a regular file" in str(refused.value), refused.value
    assert_same_tensors(snapshot(fresh2, fresh2_optimizer)["model"], before["model"], "/dev/zero: model")


def test_symbolic_links_inside_the_directory_load_and_links_out_need_the_keyword(tmp_path: Path) -> None:
    run_distributed(_link_inside_loads, 2, str(tmp_path))


# ------------------------------------------------- the other entry points
def _build_all(rank: int, world_size: int, root: str, names: list[str]) -> None:
    top = Path(root)
    model, optimizer = _trained(seed=0)
    save_checkpoint(top / "base", model, optimizer)
    canary_model, canary_optimizer = _trained(seed=7)
    save_checkpoint(top / "canary", canary_model, canary_optimizer)
    if rank == 0:
        for name in names:
            directory = top / name.replace(" ", "_").replace(".", "")
            shutil.copytree(top / "base", directory, symlinks=True)
            CASES[name][0](directory, top / "canary")
    dist.barrier()


def _plain_destination() -> dict[str, Any]:
    """What a user of plain ``dcp.load`` passes: the unsharded model's tensors."""
    return {"model": {key: value.clone() for key, value in BufferedGPT(n_blocks=1).state_dict().items() if isinstance(value, torch.Tensor)}}


def _convert_script() -> Any:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# Cases a path without our manifest check still meets (verify_checkpoint refuses the rest first).
ENTRY_POINT_CASES = [
    "relative path with ..",
    "absolute relative path",
    "symbolic link leading out",
    "FIFO item",
    "FIFO .metadata",
    "length beyond the file",
    "half chunk",
    "stored shape differs",
    "stride 0",
    "legacy item with a payload",
    "DAG bomb .metadata",
]


def _tree(top: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``top``: (size, modification time in ns)."""
    return {str(path.relative_to(top)): (path.lstat().st_size, path.lstat().st_mtime_ns) for path in top.rglob("*")}


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_entry_point_refuses_hostile_directories_and_writes_nothing(world_size: int, tmp_path: Path) -> None:
    """Each directory as saved by ``world_size`` ranks (one ``.distcp`` file
    per rank), read with no process group; the command line's converters
    write nothing anywhere (the whole tree is compared), not even their
    output."""
    run_distributed(_build_all, world_size, str(tmp_path), ENTRY_POINT_CASES)
    assert len(list((tmp_path / "base").glob("*.distcp"))) == world_size
    convert_main = _convert_script().main
    for name in ENTRY_POINT_CASES:
        directory = tmp_path / name.replace(" ", "_").replace(".", "")
        expected = CASES[name][1]
        outputs = [tmp_path / "out.pt", tmp_path / "out.safetensors", tmp_path / "cli.pt", tmp_path / "cli.safetensors"]
        entry_points: dict[str, Callable[[], Any]] = {
            "dcp.load": lambda: dcp.load(_plain_destination(), storage_reader=DirectFileSystemReader(directory), no_dist=True),
            "dcp_to_torch_save": lambda: dcp_to_torch_save(directory, outputs[0], everything=True),
            "dcp_to_safetensors": lambda: dcp_to_safetensors(directory, outputs[1]),
            "convert_checkpoint.py to-torch --everything": lambda: convert_main(["to-torch", str(directory), str(outputs[2]), "--everything"]),
            "convert_checkpoint.py to-safetensors": lambda: convert_main(["to-safetensors", str(directory), str(outputs[3])]),
        }
        if (directory / MANIFEST_NAME).exists():
            entry_points["verify_checkpoint"] = lambda: verify_checkpoint(directory, ranks_share_work=False)
        for entry, call in entry_points.items():
            tree = _tree(tmp_path)
            start = time.perf_counter()
            try:
                call()
            except CheckpointError as exc:
                assert expected in str(exc) or entry == "verify_checkpoint", f"{name} via {entry}: {exc}"
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - plain dcp.load wraps the reader's error in its own
                inner = refusal_before_writing(exc)
                assert inner is not None and expected in str(inner), f"{name} via {entry}: {type(exc).__name__}: {exc}"
            else:
                assert entry == "verify_checkpoint", f"{name} via {entry}: loaded"
            assert time.perf_counter() - start < TIME_BOUND_S, f"{name} via {entry}"
            assert not any(path.exists() for path in outputs), f"{name} via {entry}: wrote an output"
            assert _tree(tmp_path) == tree, f"{name} via {entry}: wrote or changed a file"
            assert not os.path.exists(str(directory) + ".marker"), f"{name} via {entry}: the payload ran"


def test_a_refused_global_is_never_imported(tmp_path: Path) -> None:
    """``torch.onnx`` is imported on first attribute access (torch's module
    ``__getattr__``); a ``.metadata`` naming ``torch.onnx`` is refused
    without touching it."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch\nonnx\nq\x00.")
    code = (
        "import sys; from composable_shard.checkpoint.untrusted.safe_pickle import load_metadata, PickleTrust\n"
        "from composable_shard.checkpoint import CheckpointError\n"
        f"try:\n    load_metadata({str(tmp_path / '.metadata')!r}, PickleTrust())\nexcept CheckpointError as e:\n    print('refused', e)\n"
        "print('imported' if 'torch.onnx' in sys.modules else 'not imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert "refused" in result.stdout and "torch.onnx" in result.stdout, result.stdout + result.stderr
    assert result.stdout.strip().endswith("not imported"), result.stdout


# ------------------------------------------- a kept verdict on .metadata
def test_a_kept_metadata_verdict_is_dropped_when_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_checkpoint`` reads ``.metadata`` twice; the second read keeps
    the first check's verdict ([Note: a metadata verdict kept] in
    metadata_checks.py) — only while every file it names is the same: with
    the ``.metadata`` bytes unchanged, a truncated item file, a FIFO or a
    link leading out in its place is refused again, and a re-saved file
    (another inode) is checked again."""
    from composable_shard.checkpoint.untrusted import metadata_checks

    checks: list[str] = []
    original = metadata_checks.check_metadata

    def counted(*args: Any, **kwargs: Any) -> Any:  # a spy: the real check runs
        checks.append(str(args[1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(metadata_checks, "check_metadata", counted)
    monkeypatch.setattr(metadata_checks, "_VERDICTS", {})
    values = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.arange(8, dtype=torch.float64)}
    base = tmp_path / "base"
    dcp.save(values, checkpoint_id=base, no_dist=True)
    (item,) = [path.name for path in base.glob("*.distcp")]
    outside = tmp_path / "outside.distcp"
    shutil.copy(base / item, outside)

    def read(directory: Path) -> Any:
        return DirectFileSystemReader(directory).read_metadata()

    read(base)
    read(base)
    assert len(checks) == 1, "the same bytes and files: the verdict is kept"
    loaded = {key: torch.zeros_like(value) for key, value in values.items()}
    dcp.load(loaded, storage_reader=DirectFileSystemReader(base), no_dist=True)
    assert_same_tensors(loaded, values, "load after a kept verdict")

    def truncated(d: Path) -> None:
        with open(d / item, "r+b") as stream:
            stream.truncate(os.path.getsize(d / item) // 2)

    def fifo(d: Path) -> None:
        (d / item).unlink()
        os.mkfifo(d / item)

    def link_out(d: Path) -> None:
        (d / item).unlink()
        os.symlink(outside, d / item)

    def rewritten(d: Path) -> None:  # the same bytes in a new file (another inode): checked again, loads
        data = (d / item).read_bytes()
        (d / item).unlink()
        (d / item).write_bytes(data)

    for name, change, expected in [
        ("truncated item", truncated, "claims bytes"),
        ("FIFO item", fifo, "not a regular file"),
        ("link leading out", link_out, "outside the checkpoint directory"),
        ("rewritten item", rewritten, None),
    ]:
        directory = tmp_path / name.replace(" ", "_")
        shutil.copytree(base, directory, symlinks=True)
        read(directory)  # checked and kept
        count = len(checks)
        change(directory)
        assert (directory / ".metadata").read_bytes() == (base / ".metadata").read_bytes()
        if expected is None:
            read(directory)
        else:
            with pytest.raises(CheckpointError, match=expected):
                read(directory)
        assert len(checks) == count + 1, f"{name}: the kept verdict was used"
