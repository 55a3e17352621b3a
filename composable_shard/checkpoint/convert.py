"""Owns: converting a checkpoint directory to and from one file of full
tensors — a ``torch.save`` file (the unsharded model state dict, or
everything) or a ``.safetensors`` file of the model (tied weights stored
once, as ``transformers`` writes and reads them) — with no process group.

Knows nothing of: models, flat parameters, process groups (it reads DCP
metadata and our manifest only).

Every converter reads the whole model into this machine's memory. DCP's
``format_utils.dcp_to_torch_save`` / ``torch_save_to_dcp`` do the plain
conversion, but unpickle the files unrestricted; these read through our
reader (pickles as data), verify the manifest, keep the model's key order,
give 0-dim parameters of older checkpoints their shape back, and write
atomically; what DCP gives is used as it is: its empty-state-dict planning
(``planners.DestinationLoadPlanner``) and single-process ``no_dist`` mode.

[Note: tied weights in safetensors]
safetensors refuses tensors sharing memory; ``transformers`` stores a tied
parameter once under its canonical name and ties the alias again on load.
``dcp_to_safetensors`` does the same with the aliases the manifest records,
and writes them into the file's metadata (``SAFETENSORS_ALIASES_KEY``:
alias -> canonical, JSON) so ``safetensors_to_dcp`` restores them. Load the
file with ``safetensors.torch.load_model(model, path)`` or
``from_pretrained``. Pinned by tests/checkpoint/test_convert.py.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import AbstractSet, Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .checksums import file_record
from .destinations import MODEL, OPTIM, saved_paths
from .manifest import manifest_hints, verify_checkpoint, write_manifest
from .planners import DestinationLoadPlanner
from .untrusted.reader import DirectFileSystemReader
from .refusals import refusal_before_writing
from .untrusted.safe_pickle import PickleTrust, refusal_in
from .switch import clear_staging, switch_into_place

__all__ = [
    "dcp_to_torch_save",
    "torch_save_to_dcp",
    "dcp_to_safetensors",
    "safetensors_to_dcp",
    "SAFETENSORS_ALIASES_KEY",
]

logger = logging.getLogger(__name__)

SAFETENSORS_ALIASES_KEY = "composable_shard.aliases"

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"


def _read_state(directory: Path, roots: set[str] | None, trust: PickleTrust, skip_model_keys: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    """The nested state saved in a verified directory (only ``roots``, all
    if None), read whole; model keys in the saved model order, 0-dim
    parameters with their shape back."""
    saved = saved_paths(_metadata(directory, trust))
    fill = {
        path[:2] if path[0] == MODEL and len(path) > 1 else path[:1]
        for path, _ in saved.values()
        if (roots is None or path[0] in roots) and not (path[0] == MODEL and len(path) > 1 and path[1] in skip_model_keys)
    }
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        try:
            reader = _reader(directory, trust)
            # DCP's own single-process load, as format_utils.dcp_to_torch_save runs it (dcp.load would keep
            # only the top-level keys it is given).
            _load_state_dict(state, storage_reader=reader, planner=DestinationLoadPlanner(tuple(sorted(fill, key=str))), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a refusal is said as ours
            refusal = refusal_before_writing(exc) or refusal_in(exc)
            if refusal is None:
                raise
            raise refusal from None
    manifest = manifest_hints(directory)
    _restore_scalar_shapes(state, set(manifest.get("scalar_params", [])))
    if isinstance(state.get(MODEL), dict):
        order = {key: index for index, key in enumerate(manifest.get("model_keys", []))}
        state[MODEL] = dict(sorted(state[MODEL].items(), key=lambda item: order.get(item[0], len(order))))
    return state


def dcp_to_torch_save(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    everything: bool = False,
    trusted: bool = False,
    safe_globals: Sequence[Any] | None = None,
    allow_links_outside: bool = False,
) -> None:
    """Write one ``torch.save`` file from a checkpoint directory, with no
    process group: the unsharded model state dict (original names and
    shapes, loadable by the unsharded model's ``load_state_dict``), or with
    ``everything`` the whole nested state (model, optimizer, extra). The
    checkpoint's pickles are read as data (``safe_globals`` and
    ``trusted`` as for ``load_checkpoint``)."""
    directory = Path(checkpoint_dir)
    trust = PickleTrust.of(trusted, safe_globals, allow_links_outside)
    saved_roots = {path[0] for path, _ in saved_paths(_metadata(directory, trust)).values()}
    model_only = not everything and MODEL in saved_roots
    state = _read_state(directory, {MODEL} if model_only else None, trust)
    _replace_file(Path(output_path), lambda partial: torch.save(state[MODEL] if model_only else state, partial))


def _reader(directory: Path, trust: PickleTrust) -> DirectFileSystemReader:
    return DirectFileSystemReader(
        directory, trusted=trust.trusted, safe_globals=trust.safe_globals, allow_links_outside=trust.allow_links_outside
    )


def _metadata(directory: Path, trust: PickleTrust) -> Any:
    verify_checkpoint(directory, ranks_share_work=False, allow_links_outside=trust.allow_links_outside)
    return _reader(directory, trust).read_metadata()


def _replace_file(output: Path, write: Any) -> None:
    partial = output.with_name(output.name + ".partial")
    write(partial)
    os.replace(partial, output)


def _restore_scalar_shapes(state: dict[str, Any], scalar_params: set[str]) -> None:
    """Give 0-dim parameters (and their per-element optimizer state) back
    their shape: older checkpoints store them with shape (1,)."""
    model_state = state.get(MODEL) or {}
    for key in scalar_params & set(model_state):
        model_state[key] = model_state[key].reshape(())
    optim_state = (state.get(OPTIM) or {}).get("state", {})
    for fqn in scalar_params & set(optim_state):
        for key, value in optim_state[fqn].items():
            if key != "step" and isinstance(value, torch.Tensor) and value.shape == (1,):
                optim_state[fqn][key] = value.reshape(())


def torch_save_to_dcp(input_path: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str]) -> None:
    """Write a checkpoint directory (loadable by ``load_checkpoint`` at any
    world size) from a ``torch.save`` file of a model state dict (or of a
    nested ``{"model": ..., "optim": ...}`` state), with no process group."""
    state = torch.load(input_path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"torch_save_to_dcp({input_path}): expected a saved dict, got {type(state).__name__}.")
    _write_directory(state if MODEL in state else {MODEL: state}, Path(checkpoint_dir), {})


def _write_directory(state: dict[str, Any], target: Path, aliases: dict[str, str]) -> None:
    staging = target.with_name(target.name + ".partial")
    clear_staging(staging)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(staging), no_dist=True)
    files = {p.name: file_record(p) for p in staging.iterdir() if p.name.endswith(".distcp") or p.name == ".metadata"}
    write_manifest(staging, files, list(state[MODEL]), [], aliases)
    switch_into_place(staging, target)


# ------------------------------------------------------------ safetensors
def dcp_to_safetensors(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    trusted: bool = False,
    safe_globals: Sequence[Any] | None = None,
    allow_links_outside: bool = False,
) -> None:
    """Write the model of a checkpoint directory as one ``.safetensors``
    file of full tensors (original names, shapes and dtypes; tied aliases
    stored once, see [Note: tied weights in safetensors]), with no process
    group. Non-tensor entries (extra states) have no place in safetensors
    and are left out (logged). The checkpoint's pickles are read as data
    (``safe_globals`` and ``trusted`` as for ``load_checkpoint``)."""
    from safetensors.torch import save_file

    directory = Path(checkpoint_dir)
    trust = PickleTrust.of(trusted, safe_globals, allow_links_outside)
    what = f"dcp_to_safetensors({directory})"
    aliases = dict(manifest_hints(directory).get("aliases", {}))
    if MODEL not in {path[0] for path, _ in saved_paths(_metadata(directory, trust)).values()}:
        raise ValueError(f"{what}: the checkpoint holds no model state (no 'model.*' keys). Convert a checkpoint of save_checkpoint.")
    model_state = _read_state(directory, {MODEL}, trust, skip_model_keys=set(aliases))[MODEL]
    tensors = {key: value.contiguous() for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    left_out = [key for key in model_state if key not in tensors]
    if left_out:
        logger.info("%s: left out non-tensor entries %s", what, left_out)
    metadata = {"format": "pt", SAFETENSORS_ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    _replace_file(Path(output_path), lambda partial: save_file(tensors, str(partial), metadata=metadata))


def safetensors_to_dcp(
    input_path: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str], *, aliases: dict[str, str] | None = None
) -> None:
    """Write a checkpoint directory (loadable by ``load_checkpoint`` at any
    world size) from a ``.safetensors`` file of a model, with no process
    group. Tied aliases (alias -> canonical name) come from the file's
    metadata (``dcp_to_safetensors`` records them) and ``aliases``; each is
    stored under both names, as ``save_checkpoint`` does."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    what = f"safetensors_to_dcp({input_path})"
    with safe_open(str(input_path), framework="pt") as reader:
        recorded = json.loads((reader.metadata() or {}).get(SAFETENSORS_ALIASES_KEY, "{}"))
    tied = {**recorded, **(aliases or {})}
    model_state: dict[str, Any] = dict(load_file(str(input_path)))
    unknown = sorted(canonical for canonical in tied.values() if canonical not in model_state)
    if unknown:
        raise ValueError(
            f"{what}: tied alias targets {unknown} are not in the file. Pass aliases naming tensors the file holds."
        )
    for alias, canonical in tied.items():
        model_state[alias] = model_state[canonical]
    _write_directory({MODEL: model_state}, Path(checkpoint_dir), tied)
