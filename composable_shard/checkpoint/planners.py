"""Owns: the DCP planners of checkpoint directories — a save planner and
file writer that write a tied parameter's data once while the metadata
names every alias, and a load planner that completes a destination from
the checkpoint's metadata.

Knows nothing of: models, units, our manifest (callers pass alias ->
canonical paths of the nested state dict, and which saved paths to fill).

[Note: tied aliases written once]
Plain ``dcp.save`` writes a tied parameter's bytes once per alias.
``TiedOnceSavePlanner`` drops the aliases' write items and gives each alias
the canonical name's storage metadata; ``TiedOnceFileSystemWriter.finish``
records the canonical name's storage under each alias. So ``.metadata``
lists both names with the same chunks and any DCP reader (ours, PyTorch's,
FSDP2's) reads the alias from the canonical bytes. Pinned by
tests/checkpoint/test_format.py.

[Note: destinations from the metadata]
``DestinationLoadPlanner`` adds to the state dict being loaded every saved
item under the given paths that it lacks — a new CPU tensor of the saved
size and dtype, or a placeholder for an object — as DCP's
``_EmptyStateDictLoadPlanner`` builds a whole state dict, with DCP's own
``set_element`` (lists where the path has an index). The model's shards and
the optimizer's state stay the caller's (in place); extra state, extra
states and hyperparameters are filled here. Pinned by
tests/checkpoint/test_resume.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["TiedOnceSavePlanner", "TiedOnceFileSystemWriter", "DestinationLoadPlanner", "saved_path_of"]

# Path of an alias in the nested state dict -> path of its canonical name.
AliasPaths = dict[tuple[str, ...], tuple[str, ...]]


def _flat_aliases(mappings: Any, aliases: AliasPaths) -> dict[str, str]:
    """Flat DCP key of each alias -> flat key of its canonical name, from
    the planner's mappings (flat key -> path)."""
    if not isinstance(mappings, dict):
        return {}
    flat_of = {tuple(path): flat for flat, path in mappings.items()}
    return {
        flat_of[alias]: flat_of[canonical]
        for alias, canonical in aliases.items()
        if alias in flat_of and canonical in flat_of
    }


class TiedOnceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, writing no item of a tied alias (see
    [Note: tied aliases written once])."""

    def __init__(self, aliases: AliasPaths) -> None:
        super().__init__()
        self._aliases = dict(aliases)  # alias path -> canonical path

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        skipped = _flat_aliases(self.mappings, self._aliases)
        if skipped:
            plan = dataclasses.replace(plan, items=[item for item in plan.items if item.index.fqn not in skipped])
            self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = super().create_global_plan(all_plans)
        mappings = metadata.planner_data
        for alias, canonical in _flat_aliases(mappings, self._aliases).items():
            if canonical in metadata.state_dict_metadata:
                metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[canonical]
        return global_plan, metadata


class TiedOnceFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose metadata points each tied alias at the
    bytes written for its canonical name (see [Note: tied aliases written
    once])."""

    def __init__(self, *args: Any, aliases: AliasPaths, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aliases = dict(aliases)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        aliases_of: dict[str, list[str]] = {}
        for alias, canonical in _flat_aliases(metadata.planner_data, self._aliases).items():
            aliases_of.setdefault(canonical, []).append(alias)
        shared = [
            WriteResult(
                index=MetadataIndex(alias, result.index.offset),
                size_in_bytes=result.size_in_bytes,
                storage_data=result.storage_data,
            )
            for rank_results in results
            for result in rank_results
            for alias in aliases_of.get(result.index.fqn, ())
        ]
        super().finish(metadata, [*results, shared] if shared else results)


def saved_path_of(metadata: Metadata, key: str) -> tuple[Any, ...]:
    """The path in the nested state dict of a flat DCP key."""
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return tuple(mappings.get(key, (key,)))


class DestinationLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that first completes the state dict from
    the metadata: every saved item under one of ``fill`` (path prefixes)
    that it lacks (see [Note: destinations from the metadata]); with
    ``objects_only``, only objects."""

    def __init__(self, fill: tuple[tuple[Any, ...], ...] = (), *, objects_only: bool = False) -> None:
        super().__init__()
        self._fill = fill
        self._objects_only = objects_only

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None and self._fill:
            for key, md in metadata.state_dict_metadata.items():
                path = saved_path_of(metadata, key)
                is_tensor = isinstance(md, TensorStorageMetadata)
                if (is_tensor and self._objects_only) or not any(path[: len(p)] == p for p in self._fill):
                    continue
                if not _holds(state_dict, path):
                    set_element(
                        state_dict,
                        path,
                        torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None,
                    )
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _holds(node: Any, path: tuple[Any, ...]) -> bool:
    """Whether the nested ``node`` has a value at ``path``."""
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node) and node[key] is not None:
            node = node[key]
        else:
            return False
    return True
