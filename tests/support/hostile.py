"""Owns: building hostile checkpoint directories from a valid one — its
``.metadata`` edited, a tensor item's bytes replaced (later offsets moved),
the manifest's records refreshed as whoever wrote the files would — and
hand-made pickles (a shared-tuple DAG used as a dict key).

Knows nothing of: which loading path is under test, models.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from composable_shard.checkpoint import MANIFEST_NAME
from composable_shard.checkpoint.checksums import file_record


def read_metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as stream:
        return pickle.load(stream)  # noqa: S301 - our own file, before it is edited


def write_metadata(directory: Path, metadata: Any) -> None:
    with open(directory / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    refresh_manifest(directory)


def edit_metadata(directory: Path, edit: Callable[[Any], None]) -> None:
    metadata = read_metadata(directory)
    edit(metadata)
    write_metadata(directory, metadata)


def refresh_manifest(directory: Path, extra: dict[str, Any] | None = None) -> None:
    """Record every regular file the manifest lists anew (an attacker who
    rewrites files rewrites their checksums too)."""
    path = directory / MANIFEST_NAME
    if not path.exists():
        return
    manifest = json.loads(path.read_text())
    for name in list(manifest["files"]):
        target = directory / name
        if target.is_file() and not target.is_symlink():
            manifest["files"][name] = file_record(target)
        elif target.is_symlink() and os.path.isfile(os.path.realpath(target)):
            with open(os.path.realpath(target), "rb") as stream:
                data = stream.read()
            import zlib

            manifest["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest.update(extra or {})
    path.write_text(json.dumps(manifest))


def tensor_items(metadata: Any, relative_path: str) -> list[tuple[Any, Any]]:
    """(storage index, storage info) of the tensor items of one file, by offset."""
    return sorted(
        (
            (index, info)
            for index, info in metadata.storage_data.items()
            if info.relative_path == relative_path and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
        ),
        key=lambda pair: pair[1].offset,
    )


def first_matrix_item(metadata: Any, relative_path: str = "__0_0.distcp") -> tuple[Any, Any]:
    """The first tensor item of a file that holds a matrix."""
    return next(
        (index, info)
        for index, info in tensor_items(metadata, relative_path)
        if len(metadata.state_dict_metadata[index.fqn].size) == 2 and index.fqn.startswith("model.")
    )


def replace_item(directory: Path, index: Any, make: Callable[[torch.Tensor], bytes]) -> None:
    """Replace the bytes of the item at ``index`` by ``make(its tensor)``,
    moving the later items of its file."""
    metadata = read_metadata(directory)
    info = metadata.storage_data[index]
    path = directory / info.relative_path
    data = path.read_bytes()
    tensor = torch.load(io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=True)
    new_item = make(tensor)
    delta = len(new_item) - info.length
    path.write_bytes(data[: info.offset] + new_item + data[info.offset + info.length :])
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    info.length = len(new_item)
    write_metadata(directory, metadata)


def saved(value: Any, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


def dag_pickle(depth: int) -> bytes:
    """A pickle (protocol 2) of ``{t_depth: 1}`` with ``t_0 = ()`` and
    ``t_i = (t_{i-1}, t_{i-1})``: a few bytes per level, 2**depth tuples to
    hash."""
    out = bytearray(b"\x80\x02}q\x00)q\x01")  # PROTO 2, EMPTY_DICT, BINPUT 0, EMPTY_TUPLE, BINPUT 1
    for level in range(1, depth + 1):
        out += b"0" + b"h" + bytes([level]) + b"h" + bytes([level]) + b"\x86" + b"q" + bytes([level + 1])
    # POP the last tuple, then the dict, the key, a value, SETITEM.
    out += b"0h\x00h" + bytes([depth + 1]) + b"K\x01s."
    return bytes(out)


def zip_with_data_pickle(template: bytes, data_pickle: bytes) -> bytes:
    """A ``torch.save`` archive like ``template`` whose ``data.pkl`` is
    ``data_pickle``."""
    source = zipfile.ZipFile(io.BytesIO(template))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as target:
        for member in source.infolist():
            content = data_pickle if member.filename.endswith("/data.pkl") else source.read(member)
            target.writestr(member.filename, content)
    return buffer.getvalue()
