"""Owns: composing with torch's composable ``replicate`` — marking each unit's
modules in torch's composable-API registry, and finding the modules
``replicate`` manages so ``fully_shard`` leaves them to it.

Knows nothing of: units' contents, hooks, collectives.

Public names: ``mark_fully_sharded``, ``replicated_modules``.

[Note: composing with torch's replicate]
``torch.distributed._composable.replicate`` (DDP applied to a module in
place) and ``fully_shard`` may share a model, as with FSDP2: each leaves
the other's modules alone. torch's side reads its composable-API registry
(a dict in the module's ``__dict__`` keyed by API name): ``replicate``
skips the subtree of every module registered as ``"fully_shard"`` and
refuses to replicate such a module. So every module of a unit is marked
there (``mark_fully_sharded``; only the name, never torch's state, so
torch's FSDP helpers, which read its state, do not take our units for
theirs). Our side: ``fully_shard`` treats each module registered as
``"replicate"`` below the module it is given as an ignored module (its
parameters stay plain and DDP's; units sharded earlier inside it stay
units), and refuses a module ``replicate`` manages itself.

The registry is private to torch (``_composable.contract``); it has the
same shape from our floor, 2.9.1, up. If a torch lacks it, marking does
nothing and no module is found: ``replicate`` then cannot be told apart,
as before. Pinned by tests/interop/test_composable_registry.py (FSDP2's
replicate-and-fully_shard configurations against one process).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any, Iterable

import torch.nn as nn

__all__ = ["mark_fully_sharded", "replicated_modules"]

# The module, by name: the package exports its function ``contract`` under
# the same name.
try:
    torch_contract: Any = importlib.import_module("torch.distributed._composable.contract")
except ImportError:
    torch_contract = None
if not (hasattr(torch_contract, "REGISTRY_KEY") and hasattr(torch_contract, "RegistryItem")):
    torch_contract = None  # a torch without the registry: nothing to compose with

# The names torch's composable APIs register under.
_FULLY_SHARD = "fully_shard"
_REPLICATE = "replicate"


def _registry(module: nn.Module) -> dict | None:
    if torch_contract is None:
        return None
    registry = module.__dict__.get(torch_contract.REGISTRY_KEY)
    return registry if isinstance(registry, dict) else None


def mark_fully_sharded(module: nn.Module) -> None:
    """Register ``module`` (a unit's module) as ``"fully_shard"`` in torch's
    composable-API registry ([Note: composing with torch's replicate])."""
    if torch_contract is None:
        return
    registry = module.__dict__.setdefault(torch_contract.REGISTRY_KEY, OrderedDict())
    registry.setdefault(_FULLY_SHARD, torch_contract.RegistryItem())


def replicated_modules(name: str, roots: Iterable[nn.Module]) -> set[nn.Module]:
    """The modules torch's ``replicate`` manages under ``roots`` (the
    outermost of each replicated subtree); raises if a root is one."""
    found: set[nn.Module] = set()
    for root in roots:
        registry = _registry(root)
        if registry is not None and _REPLICATE in registry:
            raise ValueError(
                f"fully_shard({name}): this module is managed by torch's replicate() (DDP), which "
                "synchronises its gradients itself. Call fully_shard on its submodules before "
                "replicate(), or on a parent module (replicate's subtree is then left to it)."
            )
        found.update(_outermost_replicated(root))
    return found


def _outermost_replicated(module: nn.Module) -> list[nn.Module]:
    found = []
    for child in module.children():
        registry = _registry(child)
        if registry is not None and _REPLICATE in registry:
            found.append(child)
        else:
            found.extend(_outermost_replicated(child))
    return found
