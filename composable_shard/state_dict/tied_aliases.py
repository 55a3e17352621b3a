"""Owns: writing a tied parameter's data once in a DCP checkpoint while its
metadata still names every alias — a save planner that leaves the aliases'
write items out and a file writer whose metadata points each alias at the
canonical name's bytes. See [Note: tied aliases written once].

Knows nothing of: models, units, our manifest (callers pass alias ->
canonical paths of the nested state dict).

Public names: ``TiedOnceSavePlanner``, ``TiedOnceFileSystemWriter``.

[Note: tied aliases written once]
A state dict names a tied parameter under every alias (a GPT's
``tok_emb.weight`` and ``head.weight``), and plain ``dcp.save`` writes the
same bytes once per alias. ``save_checkpoint`` writes them once, as
``transformers`` does, but keeps every name readable by any DCP reader:

- ``TiedOnceSavePlanner`` drops the aliases' write items from each rank's
  plan (so nothing is written for them) and, on the coordinator, gives each
  alias the canonical name's storage metadata in the global metadata;
- ``TiedOnceFileSystemWriter.finish`` adds, for every write result of a
  canonical name, the same storage record under the alias.

So ``.metadata`` lists both names with the same chunks, and reading the
alias (our reader, PyTorch's, FSDP2's ``dcp.load``, the converters) reads the
canonical name's bytes. Aliases are recorded in our manifest as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["TiedOnceSavePlanner", "TiedOnceFileSystemWriter"]

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
