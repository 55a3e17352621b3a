"""Checkpoints are data (composable_shard/checkpoint/untrusted/safe_pickle.py, [Note:
checkpoints are data]): a checkpoint whose pickles carry a code payload — in
``.metadata`` (with and without our manifest), in ``extra_state``, in a
module's extra state, in a bytes item of a plain ``dcp.save``, in the
optimizer's hyperparameters, in a tensor item — is refused by every loading
path (``load_checkpoint``, plain ``dcp.load`` through
``DirectFileSystemReader``, the converters and their command line) with a
``CheckpointError`` naming the file, the item and the global; the payload
never runs (no marker file) and the model and optimizer are unchanged. With
``trusted=True`` the same payload does run (so it is a real one). Plain
extra states round-trip, user types are admitted through
``safe_globals`` / ``torch.serialization``, and a checkpoint written by an
earlier version (tests/checkpoint/fixtures) still loads exactly."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from composable_shard import (
    CheckpointError,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from composable_shard.checkpoint import (
    MANIFEST_NAME,
    DirectFileSystemReader,
    UnsafeCheckpointError,
    dcp_to_safetensors,
    dcp_to_torch_save,
    verify_checkpoint,
)
from composable_shard.checkpoint.checksums import file_record

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, train_steps

FIXTURES = Path(__file__).parent / "fixtures"


class CodePayload:
    """Unpickling this runs code, as an attacker's would: it creates
    ``marker`` (through ``exec``, or ``os.system`` with ``how="system"``)."""

    def __init__(self, marker: str, how: str = "exec") -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        if self.how == "system":
            return os.system, (f"touch '{self.marker}'",)
        return exec, (f"open({self.marker!r}, 'w').close()",)


@dataclasses.dataclass
class Schedule:
    """A user type in extra_state: refused until admitted."""

    warmup: int
    peak: float


# ----------------------------------------------------------- checkpoints
def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim_state": {fqn: dict(sorted(values.items())) for fqn, values in optim["state"].items()},
        "optim_groups": copy.deepcopy(optim["param_groups"]),
        "count": model.counter.count,
    }


def _assert_unchanged(before: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str) -> None:
    after = _snapshot(model, optimizer)
    assert_same_tensors(after["model"], before["model"], f"{what}: model")
    assert_same_tensors(after["optim_state"], before["optim_state"], f"{what}: optimizer state")
    assert after["optim_groups"] == before["optim_groups"], what
    assert after["count"] == before["count"], what


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = shard(BufferedGPT(n_blocks=2), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(steps))
    return model, optimizer


def _rewrite_metadata(directory: Path, payload: CodePayload) -> None:
    """Put ``payload`` into ``.metadata`` (rank 0), and where there is a
    manifest, record the new file in it (whoever writes a checkpoint writes
    its checksums too)."""
    metadata_path = directory / ".metadata"
    with open(metadata_path, "rb") as stream:
        metadata = pickle.load(stream)  # noqa: S301 - our own file, before the payload is in
    metadata.planner_data["composable_shard.payload"] = payload
    with open(metadata_path, "wb") as stream:
        pickle.dump(metadata, stream)
    manifest_path = directory / MANIFEST_NAME
    if manifest_path.exists():
        import json

        manifest = json.loads(manifest_path.read_text())
        manifest["files"][".metadata"] = file_record(metadata_path)
        manifest_path.write_text(json.dumps(manifest))


def _write_poisoned(case: str, directory: Path, marker: str) -> None:
    """A checkpoint of a trained model carrying a code payload where
    ``case`` says (collective)."""
    model, optimizer = _trained(seed=0, steps=2)
    payload = CodePayload(marker, how="system" if case.endswith("system") else "exec")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if case in ("metadata_with_manifest", "metadata_with_manifest_system"):
        save_checkpoint(directory, model, optimizer, extra_state={"step": 2})
    elif case == "metadata_without_manifest":
        dcp.save(state, checkpoint_id=directory)
    elif case == "extra_state":
        save_checkpoint(directory, model, optimizer, extra_state={"step": 2, "evil": payload})
    elif case == "module_extra_state":
        model.counter.count = payload
        save_checkpoint(directory, model, optimizer)
    elif case == "bytes_item_without_manifest":
        dcp.save({**state, "extra": {"step": 2, "evil": payload}}, checkpoint_id=directory)
    elif case == "optimizer_hyperparameter":
        optimizer.param_groups[1]["evil"] = payload
        save_checkpoint(directory, model, optimizer)
    else:
        raise ValueError(case)
    if case.startswith("metadata") and dist.get_rank() == 0:
        _rewrite_metadata(directory, payload)
    dist.barrier()


POISONED = {  # case -> (the file the refusal names, the global it names)
    "metadata_with_manifest": (".metadata", "builtins.exec"),
    "metadata_with_manifest_system": (".metadata", "posix.system"),
    "metadata_without_manifest": (".metadata", "builtins.exec"),
    "extra_state": (".distcp", "builtins.exec"),
    "module_extra_state": (".distcp", "builtins.exec"),
    "bytes_item_without_manifest": (".distcp", "builtins.exec"),
    "optimizer_hyperparameter": (".distcp", "builtins.exec"),
}
ITEMS = {  # case -> the item a bytes-item refusal names
    "extra_state": "extra.evil",
    "module_extra_state": "model.counter._extra_state",
    "bytes_item_without_manifest": "extra.evil",
    "optimizer_hyperparameter": "optim.param_groups",
}


def _plain_destination(case: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a user's plain ``dcp.load`` would load into: our state dicts
    (views of the model's shards) and the saved objects' places."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if case in ("extra_state", "bytes_item_without_manifest"):
        state["extra"] = {"step": None, "evil": None}
    if case == "optimizer_hyperparameter":
        state["optim"]["param_groups"][1]["evil"] = None
    return state


def _assert_refused(exc: BaseException, case: str, marker: str, what: str) -> None:
    file, wanted = POISONED[case]
    message = str(exc)
    assert file in message and wanted in message and "trusted=True" in message, (what, message)
    if case in ITEMS:
        assert ITEMS[case] in message, (what, message)
    assert not os.path.exists(marker), f"{what}: the payload ran"


def _every_loading_path_refuses(rank: int, world_size: int, root: str) -> list[str]:
    cases = []
    for case in POISONED:
        directory = Path(root, case)
        marker = f"{root}/{case}.marker"
        _write_poisoned(case, directory, marker)
        model, optimizer = _trained(seed=1, steps=1)
        before = _snapshot(model, optimizer)
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(directory, model, optimizer)
        assert isinstance(refused.value, UnsafeCheckpointError), (case, refused.value)
        _assert_refused(refused.value, case, marker, f"{case}: load_checkpoint")
        _assert_unchanged(before, model, optimizer, f"{case}: load_checkpoint")
        with pytest.raises(CheckpointException) as refused:  # DCP's, carrying ours from every rank
            destination = _plain_destination(case, model, optimizer)
            dcp.load(destination, storage_reader=DirectFileSystemReader(directory))
        _assert_refused(refused.value, case, marker, f"{case}: dcp.load with DirectFileSystemReader")
        _assert_unchanged(before, model, optimizer, f"{case}: dcp.load with DirectFileSystemReader")
        # The model still loads a good checkpoint and trains.
        save_checkpoint(f"{root}/good", *_trained(seed=2, steps=1))
        load_checkpoint(f"{root}/good", model, optimizer)
        train_steps(model, optimizer, range(1))
        cases.append(case)
    return cases


def _convert_script() -> Any:
    """scripts/convert_checkpoint.py as a module (its main takes argv)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).parents[2] / "scripts" / "convert_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_payloads_are_refused_by_every_loading_path_and_never_run(tmp_path: Path) -> None:
    cases = run_distributed(_every_loading_path_refuses, 2, str(tmp_path))
    assert cases[0] == list(POISONED)
    # The converters and their command line, and verify_checkpoint, with no process group.
    convert_main = _convert_script().main
    for case in POISONED:
        directory, marker = tmp_path / case, str(tmp_path / f"{case}.marker")
        has_manifest = (directory / MANIFEST_NAME).exists()
        assert verify_checkpoint(directory, ranks_share_work=False) == has_manifest
        assert not os.path.exists(marker), f"{case}: verify_checkpoint ran the payload"
        converters = {
            "dcp_to_torch_save": lambda: dcp_to_torch_save(directory, tmp_path / "out.pt", everything=True),
            "dcp_to_safetensors": lambda: dcp_to_safetensors(directory, tmp_path / "out.safetensors"),
            "convert_checkpoint.py to-torch": lambda: convert_main(["to-torch", str(directory), str(tmp_path / "o.pt"), "--everything"]),
        }
        for name, convert in converters.items():
            if name == "dcp_to_safetensors" and case in ("extra_state", "bytes_item_without_manifest", "optimizer_hyperparameter"):
                continue  # it reads the model only: those payloads are never read
            with pytest.raises(CheckpointError) as refused:
                convert()
            _assert_refused(refused.value, case, marker, f"{case}: {name}")
        # The payload is real: trusting the checkpoint runs it.
        dcp_to_torch_save(directory, tmp_path / "trusted.pt", everything=True, trusted=True)
        assert os.path.exists(marker), f"{case}: trusted=True should have run the payload (is the test's payload real?)"


def _tensor_item_payload(rank: int, world_size: int, root: str) -> None:
    """A tensor item whose data.pkl calls exec (an item rewritten by whoever
    wrote the checkpoint) is refused by every rank that reads it, before
    that rank reads any tensor (one rank here: it reads every item)."""
    directory, marker = Path(root, "tensor"), f"{root}/tensor.marker"
    model, optimizer = _trained(seed=0, steps=2)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory)
    dist.barrier()
    if rank == 0:
        _poison_first_tensor_item(directory, marker)
    dist.barrier()
    fresh, fresh_optimizer = _trained(seed=1, steps=1)
    before = _snapshot(fresh, fresh_optimizer)
    with pytest.raises(CheckpointException) as refused:
        dcp.load({"model": get_model_state_dict(fresh)}, storage_reader=DirectFileSystemReader(directory))
    assert "builtins.exec" in str(refused.value) and ".distcp" in str(refused.value), refused.value
    assert not os.path.exists(marker)
    _assert_unchanged(before, fresh, fresh_optimizer, "tensor item payload")


def _poison_first_tensor_item(directory: Path, marker: str) -> None:
    """Replace the first tensor item of ``__0_0.distcp`` by a ``torch.save``
    of that tensor together with a code payload, and move the later items'
    offsets in ``.metadata`` to match."""
    import io

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with open(directory / ".metadata", "rb") as stream:
        metadata = pickle.load(stream)  # noqa: S301 - our own file
    index, info = next(
        (index, info)
        for index, info in sorted(metadata.storage_data.items(), key=lambda pair: pair[1].offset)
        if info.relative_path == "__0_0.distcp" and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
    )
    path = directory / info.relative_path
    data = path.read_bytes()
    tensor = torch.load(io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=True)
    replacement = io.BytesIO()
    torch.save({"tensor": tensor, "payload": CodePayload(marker)}, replacement)
    new_item = replacement.getvalue()
    delta = len(new_item) - info.length
    path.write_bytes(data[: info.offset] + new_item + data[info.offset + info.length :])
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    info.length = len(new_item)
    with open(directory / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)


def test_tensor_item_with_a_code_payload_is_refused_before_any_tensor_is_read(tmp_path: Path) -> None:
    run_distributed(_tensor_item_payload, 1, str(tmp_path))


# ------------------------------------------------------ what still loads
EXTRA = {
    "step": 3,
    "lr": 0.5,
    "note": "resume",
    "ids": [1, 2, 3],
    "pair": (4, "x"),
    "table": {"a": [1.5, 2.5], "b": {"c": None}},
    "scale": torch.arange(3.0),
    "nothing": None,
    "flag": True,
}


def _plain_objects_round_trip(rank: int, world_size: int, root: str) -> None:
    model, optimizer = _trained(seed=0, steps=2)
    model.counter.count = 5
    save_checkpoint(f"{root}/plain", model, optimizer, extra_state=EXTRA)
    expected = _snapshot(model, optimizer)
    fresh, fresh_optimizer = _trained(seed=1, steps=1)
    extra = load_checkpoint(f"{root}/plain", fresh, fresh_optimizer)
    assert_same_tensors(extra, EXTRA, "extra_state")
    _assert_unchanged(expected, fresh, fresh_optimizer, "plain objects")  # = the saved ones
    # A type of the user's: refused by default, naming it; admitted by argument or by torch's list.
    save_checkpoint(f"{root}/typed", model, optimizer, extra_state={"schedule": Schedule(10, 0.1)})
    with pytest.raises(CheckpointError, match=r"Schedule.*safe_globals"):
        load_checkpoint(f"{root}/typed", fresh, fresh_optimizer)
    assert load_checkpoint(f"{root}/typed", fresh, fresh_optimizer, safe_globals=[Schedule]) == {"schedule": Schedule(10, 0.1)}
    with torch.serialization.safe_globals([Schedule]):
        assert load_checkpoint(f"{root}/typed", fresh, fresh_optimizer) == {"schedule": Schedule(10, 0.1)}
    with pytest.raises(TypeError, match="trusted"):
        load_checkpoint(f"{root}/typed", fresh, fresh_optimizer, trusted="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="safe_globals takes classes and functions"):
        load_checkpoint(f"{root}/typed", fresh, fresh_optimizer, safe_globals=["tests.Schedule"])
    train_steps(fresh, fresh_optimizer, range(3, 4))  # still trains after the refusals


def test_plain_extra_state_round_trips_and_user_types_load_once_admitted(tmp_path: Path) -> None:
    run_distributed(_plain_objects_round_trip, 2, str(tmp_path))


def _old_checkpoint_loads(rank: int, world_size: int, directory: str, expected_path: str) -> None:
    expected = torch.load(expected_path, weights_only=True)
    torch.manual_seed(1)
    model = shard(BufferedGPT(n_blocks=1), "policy")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(1))
    extra = load_checkpoint(directory, model, optimizer)
    assert_same_tensors(extra, expected["extra"], "extra_state")
    assert_same_tensors(get_model_state_dict(model, options=FULL), expected["model"], "model")
    assert model.counter.count == 7
    state = get_optimizer_state_dict(model, optimizer, options=FULL)
    assert_same_tensors(
        {fqn: dict(sorted(v.items())) for fqn, v in state["state"].items()},
        {fqn: dict(sorted(v.items())) for fqn, v in expected["optim"]["state"].items()},
        "optimizer state",
    )
    assert state["param_groups"] == expected["optim"]["param_groups"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_checkpoint_of_an_earlier_version_loads_exactly(world_size: int) -> None:
    directory = FIXTURES / "checkpoint_0a0add2"
    run_distributed(_old_checkpoint_loads, world_size, str(directory), str(FIXTURES / "checkpoint_0a0add2.expected.pt"))
