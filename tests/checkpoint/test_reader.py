"""``DirectFileSystemReader`` (the storage reader ``load_checkpoint`` uses)
gives bit-identical results to PyTorch's ``FileSystemReader``: for our state
dicts and FSDP2's, across world sizes (2 -> 4, 4 -> 2), fp32 and bf16, with
optimizer state and bytes items; for boxes that narrow a saved chunk's inner
dimension and for non-contiguous destinations (through one temporary); and
it hands items it must not read itself (a transform such as compression,
another serialization, an unknown pickle, another dtype) to the stock
reader, with the same result.

Each comparison loads the same checkpoint twice into destinations filled
with NaN, once with each reader, and compares every destination byte for
byte (and that no NaN is left); the reader's ``counts`` show which of its
paths were taken, so a comparison cannot pass by everything falling back."""

from __future__ import annotations

import io
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_state_dict
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

try:  # torch releases with stream transforms (compression, encryption) of DCP items
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
except ImportError:  # older torch writes no transformed items: nothing to fall back for
    ExtensionRegistry = StreamTransformExtension = None  # type: ignore[assignment,misc]
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from composable_shard import get_model_state_dict, get_optimizer_state_dict
from composable_shard.state_dict import RangeShardedTensor
from composable_shard.checkpoint import DirectFileSystemReader

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.state_dicts import make_optimizer, shard, shard_with_fsdp2, train_steps

STACKS = ("composable_shard", "fsdp2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------- helpers
def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a (nested) state dict by path; tensors as the local
    tensor a rank holds (our boxes' range, a DTensor's shard)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_leaves(value, f"{prefix}/{key}"))
        return out
    if isinstance(tree, list):
        out = {}
        for index, value in enumerate(tree):
            out.update(_leaves(value, f"{prefix}[{index}]"))
        return out
    if isinstance(tree, RangeShardedTensor):
        return {prefix: tree.local}
    if hasattr(tree, "to_local"):
        return {prefix: tree.to_local()}
    return {prefix: tree}


def _fill_nan(tree: Any) -> None:
    """So that an element no reader wrote shows."""
    with torch.no_grad():
        for value in _leaves(tree).values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.fill_(math.nan)


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _assert_bit_identical(direct: Any, stock: Any, what: str) -> None:
    ours, theirs = _leaves(direct), _leaves(stock)
    assert list(ours) == list(theirs), f"{what}: keys differ"
    for key, expected in theirs.items():
        got = ours[key]
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape, (what, key)
            assert np.array_equal(_as_bytes(got), _as_bytes(expected)), f"{what} {key}: the readers' bytes differ"
            if expected.is_floating_point():
                assert not torch.isnan(expected).any(), f"{what} {key}: the stock reader left elements unread"
        else:
            assert got == expected, (what, key, got, expected)


def _load_with_both(make: Callable[[], Any], path: str, what: str, **reader_kwargs: Any) -> dict[str, int]:
    """Load ``path`` into two fresh destinations from ``make()`` (filled
    with NaN), one per reader; check they are bit-identical; return the
    direct reader's counts."""
    stock, direct = make(), make()
    _fill_nan(stock)
    _fill_nan(direct)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        dcp.load(stock, storage_reader=FileSystemReader(path, **reader_kwargs))
        reader = DirectFileSystemReader(path, **reader_kwargs)
        dcp.load(direct, storage_reader=reader)
    _assert_bit_identical(direct, stock, what)
    return reader.counts


# -------------------------------------------- our and FSDP2's state dicts
def _model_and_state(stack: str, dtype: torch.dtype, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Any]]:
    torch.manual_seed(seed)
    model = TinyGPT().to(dtype)
    model = shard_with_fsdp2(model) if stack == "fsdp2" else shard(model, "manual")
    optimizer = make_optimizer("adamw", model)

    def state() -> dict[str, Any]:
        if stack == "fsdp2":
            return {
                "model": torch_state_dict.get_model_state_dict(model),
                "optim": torch_state_dict.get_optimizer_state_dict(model, optimizer),
            }
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}

    return model, optimizer, state


def _save_stacks(rank: int, world_size: int, root: str) -> None:
    """Each stack, in each dtype, trains two steps and saves with plain DCP."""
    for stack in STACKS:
        for dtype_name, dtype in DTYPES.items():
            model, optimizer, state = _model_and_state(stack, dtype, seed=0)
            train_steps(model, optimizer, range(2))
            dcp.save(state(), checkpoint_id=f"{root}/{stack}-{dtype_name}")


def _load_stacks(rank: int, world_size: int, root: str) -> dict[str, dict[str, int]]:
    """Every saved checkpoint into both stacks (another world size), with
    both readers into fresh models (other initial values and no optimizer
    steps taken: the optimizer state is only in the destinations DCP
    builds, so it is read into a fresh trained-once optimizer)."""
    counts = {}
    for saved in STACKS:
        for dtype_name, dtype in DTYPES.items():
            for stack in STACKS:

                def make() -> dict[str, Any]:
                    model, optimizer, state = _model_and_state(stack, dtype, seed=1)
                    train_steps(model, optimizer, range(1))  # so that the optimizer has state to load into
                    return state()

                what = f"{saved} {dtype_name} checkpoint into {stack} at {world_size} ranks"
                counts[what] = _load_with_both(make, f"{root}/{saved}-{dtype_name}", what)
    return counts


@pytest.mark.parametrize("first, second", [(2, 4), (4, 2)], ids=["2-4", "4-2"])
def test_reader_matches_stock_reader_bit_for_bit_across_world_sizes_and_stacks(first: int, second: int, tmp_path: Path) -> None:
    run_distributed(_save_stacks, first, str(tmp_path))
    per_rank = run_distributed(_load_stacks, second, str(tmp_path))
    for what in per_rank[0]:
        counts = [rank_counts[what] for rank_counts in per_rank]
        assert sum(c["direct"] for c in counts) > 0, (what, counts)  # most items straight into the shards
        assert sum(c["stock"] for c in counts) > 0, (what, counts)  # the optimizer's hyperparameters (bytes)


# ------------------------------------ narrows of inner dimensions, dtypes
def _narrows_and_dtypes(rank: int, world_size: int, root: str) -> dict[str, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # older torch (2.4): DTensor under its earlier name
        from torch.distributed._tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=generator)
    half = torch.randn(4, 10, generator=generator).to(torch.bfloat16)
    transposed = torch.randn(6, 5, generator=generator).t()  # saved with its strides (5 x 6 of a 6 x 5 storage)
    saved = {
        "full": full,
        "half": half,
        "transposed": transposed,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "columns": distribute_tensor(full, mesh, [Shard(1)]),  # each rank saves (8, 6 / world) chunks
        "extra": {"note": "bytes item", "step": 7},
    }
    dcp.save(saved, checkpoint_id=f"{root}/plain")
    counts = {}

    def by_columns() -> dict[str, Any]:  # narrows of the saved (8, 6) and (4, 10) along dim 1
        return {
            "full": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
            "half": distribute_tensor(torch.zeros(4, 10, dtype=torch.bfloat16), mesh, [Shard(1)]),
            "transposed": distribute_tensor(torch.zeros(5, 6), mesh, [Shard(0)]),
            "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(0.0),
            "extra": {"note": None, "step": None},
        }

    counts["inner narrows"] = _load_with_both(by_columns, f"{root}/plain", "inner narrows")

    def whole() -> dict[str, Any]:  # the saved column chunks into a full tensor: non-contiguous destinations
        return {"columns": torch.zeros(8, 6), "full": torch.zeros(8, 6), "transposed": torch.zeros(5, 6)}

    counts["non-contiguous destinations"] = _load_with_both(whole, f"{root}/plain", "non-contiguous destinations")

    def other_dtypes() -> dict[str, Any]:  # DCP converts on copy_; the stock reader does it
        return {"full": torch.zeros(8, 6, dtype=torch.bfloat16), "half": torch.zeros(4, 10)}

    counts["other dtypes"] = _load_with_both(other_dtypes, f"{root}/plain", "other dtypes")
    return counts


def test_reader_matches_stock_reader_for_inner_narrows_non_contiguous_destinations_and_dtype_changes(tmp_path: Path) -> None:
    per_rank = run_distributed(_narrows_and_dtypes, 2, str(tmp_path))
    for counts in per_rank:
        # Column shards of a row-major chunk and a transposed chunk are strided: one temporary each.
        assert counts["inner narrows"]["temporary"] >= 3 and counts["inner narrows"]["direct"] >= 1, counts
        assert counts["non-contiguous destinations"]["temporary"] >= 2, counts
        assert counts["other dtypes"] == {"direct": 0, "temporary": 0, "stock": 2}, counts


# ------------------------------------------------- fallbacks to the stock
class _XorTransform(StreamTransformExtension or object):  # type: ignore[misc]
    """A stream transform (every byte XOR 0x5A) in DCP's extension
    registry: a stand-in for compression or encryption."""

    @staticmethod
    def registry_name() -> str:
        return "composable_shard_test_xor"

    @staticmethod
    def from_descriptor(version: str) -> "_XorTransform":
        return _XorTransform()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: Any) -> Any:
        return _XorStream(output, writing=True)

    def transform_from(self, input: Any) -> Any:
        return _XorStream(input, writing=False)


def _xor(data: Any) -> bytes:
    return (np.frombuffer(bytes(data), dtype=np.uint8) ^ 0x5A).tobytes()


class _XorStream(io.RawIOBase):
    def __init__(self, inner: Any, *, writing: bool) -> None:
        super().__init__()
        self._inner, self._writing = inner, writing

    def writable(self) -> bool:
        return self._writing

    def readable(self) -> bool:
        return not self._writing

    def write(self, data: Any) -> int:
        payload = memoryview(data).cast("B")
        self._inner.write(_xor(payload))
        return len(payload)

    def readinto(self, buffer: Any) -> int:
        data = self._inner.read(len(buffer))
        buffer[: len(data)] = _xor(data)
        return len(data)


def _state(generator: torch.Generator) -> dict[str, Any]:
    return {
        "w": torch.randn(8, 6, generator=generator),
        "b": torch.randn(7, generator=generator).to(torch.bfloat16),
        "extra": {"note": "bytes item"},
    }


def _empty_state() -> dict[str, Any]:
    return {"w": torch.zeros(8, 6), "b": torch.zeros(7, dtype=torch.bfloat16), "extra": {"note": None}}


def _rewrite_items(directory: Path, serialize: Callable[[torch.Tensor], bytes]) -> None:
    """Rewrite a one-process checkpoint with every tensor item serialized by
    ``serialize`` (the metadata's offsets updated): a valid checkpoint the
    stock reader reads, in a form our reader must not parse itself."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    files: dict[str, bytearray] = {}
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        with open(directory / info.relative_path, "rb") as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            data = serialize(torch.load(io.BytesIO(data), weights_only=True))
        out = files.setdefault(info.relative_path, bytearray())
        info.offset, info.length = len(out), len(data)
        out += data
    for name, data in files.items():
        (directory / name).write_bytes(bytes(data))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _legacy(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _as_parameter(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(nn.Parameter(tensor, requires_grad=False), buffer)  # pickled through _rebuild_parameter
    return buffer.getvalue()


_FORMS = ["legacy serialization", "unknown pickle"] + (["transform"] if ExtensionRegistry is not None else [])


@pytest.mark.parametrize("form", _FORMS)
def test_items_the_reader_cannot_parse_go_to_the_stock_reader_with_the_same_result(form: str, tmp_path: Path) -> None:
    saved = _state(torch.Generator().manual_seed(0))
    kwargs: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if form == "transform":
            registry = ExtensionRegistry()
            registry.register(_XorTransform)
            kwargs["_extension_registry"] = registry
            dcp.save(saved, storage_writer=FileSystemWriter(tmp_path, _extensions=[_XorTransform()]), no_dist=True)
        else:
            dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
            _rewrite_items(tmp_path, _legacy if form == "legacy serialization" else _as_parameter)
        stock, direct = _empty_state(), _empty_state()
        dcp.load(stock, storage_reader=FileSystemReader(tmp_path, **kwargs), no_dist=True)
        reader = DirectFileSystemReader(tmp_path, **kwargs)
        dcp.load(direct, storage_reader=reader, no_dist=True)
    _assert_bit_identical(direct, stock, form)
    _assert_bit_identical(direct, saved, form)  # and what was saved
    assert reader.counts == {"direct": 0, "temporary": 0, "stock": 3}, reader.counts


def test_saved_tensor_description_is_what_torch_load_gives() -> None:
    """An item's description (torch's zip reader and weights-only unpickler
    on meta storages, no tensor bytes read) says what ``torch.load`` gives:
    dtype, size, stride, storage offset, and the storage's bytes start where
    it says, for views, transposes, empty and 0-dim tensors."""
    from composable_shard.checkpoint.untrusted.saved_tensor import ItemView, describe_item

    base = torch.arange(60, dtype=torch.float64).view(6, 10)
    for tensor in (base, base[1:, 2:7], base.t(), torch.zeros(0, 3), torch.tensor(2.5, dtype=torch.bfloat16)):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        data = b"pad" + buffer.getvalue()  # an item at an offset of its file, as in a .distcp file
        saved = describe_item(ItemView(io.BytesIO(data), 3, len(data) - 3))
        loaded = torch.load(io.BytesIO(data[3:]), weights_only=True)
        facts = (saved.dtype, saved.size, saved.stride, saved.storage_offset)
        assert facts == (loaded.dtype, tuple(loaded.shape), loaded.stride(), loaded.storage_offset()), facts
        storage = torch.empty(0, dtype=loaded.dtype).set_(loaded.untyped_storage())
        assert saved.storage_numel == storage.numel()
        raw = data[saved.data_start : saved.data_start + storage.numel() * storage.element_size()]
        assert raw == storage.view(torch.uint8).numpy().tobytes()


def _truncated_zip64_extra(tensor: torch.Tensor) -> bytes:
    """``torch.save`` of ``tensor`` whose last zip directory entry claims
    zip64 sizes in an extra field that holds 4 of its 16 bytes (same length)."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    data = bytearray(buffer.getvalue())
    last = data.rfind(b"PK\x01\x02")  # the last central directory entry
    name_length = int.from_bytes(data[last + 28 : last + 30], "little")
    data[last + 20 : last + 28] = b"\xff" * 8  # compressed and uncompressed sizes: "see the zip64 extra field"
    data[last + 28 : last + 30] = (name_length - 4).to_bytes(2, "little")
    data[last + 30 : last + 32] = (4).to_bytes(2, "little")
    data[last + 46 + name_length - 4 : last + 46 + name_length] = b"\x01\x00\x10\x00"  # zip64 extra: id 1, 16 bytes
    return bytes(data)


def test_malformed_item_is_a_checkpoint_error_naming_the_file_and_item(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_state(torch.Generator().manual_seed(0)), checkpoint_id=tmp_path, no_dist=True)
        _rewrite_items(tmp_path, _truncated_zip64_extra)
        with pytest.raises(CheckpointException) as raised:
            dcp.load(_empty_state(), storage_reader=DirectFileSystemReader(tmp_path), no_dist=True)
    message = str(raised.value)
    assert "CheckpointError" in message and "__0_0.distcp" in message and "is malformed (" in message, message
    assert "the item 'w'" in message or "the item 'b'" in message, message
