"""Owns: what the Lightning Trainer strategy and the Fabric strategy share —
checking the ``fully_shard`` options they take, sharding the module (by
policy, or checking that the user's code did), the precisions they accept,
and splitting a Lightning checkpoint between composable_shard's checkpoint
directory and its ``extra_state``.

Knows nothing of: the Trainer's loops or Fabric's wrappers (lightning.py and
lightning_fabric.py); composable_shard's internals (public API only).

Public names (for the two strategy modules): ``ShardOptions``,
``SUPPORTED_PRECISIONS``, ``check_precision``, ``shard_module``,
``has_units``, ``check_half_precision_module``, ``gradient_sync_disabled``,
``checkpoint_optimizers``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn

from composable_shard.controls.per_unit import set_requires_gradient_sync
from composable_shard.entry import fully_shard, is_fully_sharded
from composable_shard.policy import Policy, select_units

__all__ = [
    "ShardOptions",
    "SUPPORTED_PRECISIONS",
    "check_precision",
    "shard_module",
    "has_units",
    "check_half_precision_module",
    "gradient_sync_disabled",
    "checkpoint_optimizers",
]

logger = logging.getLogger(__name__)

# Lightning precision strings the strategies run; anything else is refused
# before the model is touched. "bf16-mixed": autocast to bf16 over fp32
# parameters, gradients reduced in fp32 (what Lightning's DDP does);
# "bf16-true": the module converted to bf16 before sharding.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")

# fully_shard's keyword arguments the strategies pass through (policy is the
# strategy's first argument; the module is Lightning's).
_FULLY_SHARD_KWARGS = tuple(
    name for name in inspect.signature(fully_shard).parameters if name not in ("module", "policy")
)


@dataclass
class ShardOptions:
    """What a strategy was built with: the policy (``None``: the user's code
    calls ``fully_shard``) and the other ``fully_shard`` keyword arguments."""

    owner: str  # the strategy's class name, for messages
    policy: Policy | set[type[nn.Module]] | frozenset[type[nn.Module]] | None
    fully_shard_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fully_shard_kwargs) - set(_FULLY_SHARD_KWARGS))
        if unknown:
            raise TypeError(
                f"{self.owner}: unknown keyword argument(s) {unknown}. It takes policy and fully_shard's "
                f"keyword arguments: {', '.join(_FULLY_SHARD_KWARGS)}."
            )
        if self.policy is not None and not isinstance(self.policy, (Policy, set, frozenset)):
            raise TypeError(
                f"{self.owner}: policy must be a composable_shard Policy or a set of module classes, got "
                f"{type(self.policy).__name__}. Pass e.g. policy={{Block}} or ModuleWrapPolicy({{Block}})."
            )


def check_precision(owner: str, precision: str) -> None:
    """Refuse a precision the strategies do not run (before any change)."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"{owner}: precision={precision!r} is not supported. Use one of {list(SUPPORTED_PRECISIONS)} "
            "(for fp16 training pass mixed_precision=MixedPrecision(...) to the strategy with precision='32-true')."
        )


def has_units(module: nn.Module) -> bool:
    """Whether ``fully_shard`` made a unit of ``module`` or of a module in it."""
    return any(is_fully_sharded(m) for m in module.modules())


def shard_module(options: ShardOptions, module: nn.Module, *, hook: str) -> None:
    """Shard ``module`` by the strategy's policy, or check that ``hook`` (the
    user's code) already did. Refuses, before changing anything, a policy
    that picks no module, a policy given when the user's code sharded too,
    and a model with no unit."""
    name = type(module).__name__
    if options.policy is None:
        if not has_units(module):
            raise ValueError(
                f"{options.owner}: {name} has no module that fully_shard made a unit after {hook}. "
                f"Call fully_shard on its blocks (and on the module that holds them) in {hook}, or pass "
                f"{options.owner}(policy={{Block, ...}})."
            )
        return
    if has_units(module):
        raise ValueError(
            f"{options.owner}: {name} was already given to fully_shard (in {hook}) and the strategy has "
            f"policy={options.policy!r}. Choose one: drop the policy, or the fully_shard calls in {hook}."
        )
    if not select_units(module, options.policy, is_fully_sharded):
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(
            f"{options.owner}: policy={options.policy!r} picks no module of {name} (its module classes: "
            f"{classes}). Name the classes of its repeated blocks."
        )
    policy = set(options.policy) if isinstance(options.policy, frozenset) else options.policy
    fully_shard(module, policy=policy, **options.fully_shard_kwargs)
    logger.info("%s: applied fully_shard to %s with policy %r", options.owner, name, options.policy)


def check_half_precision_module(owner: str, module: nn.Module, dtype: torch.dtype) -> bool:
    """For "bf16-true": whether ``module`` may still be converted (no unit
    yet). A sharded module must already hold ``dtype`` parameters (built
    under Lightning's init context); converting its shards is refused."""
    if not has_units(module):
        return True
    wrong = [(n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != dtype]
    if wrong:
        param, found = wrong[0]
        raise ValueError(
            f"{owner}: precision 'bf16-true' needs {dtype} parameters, but {type(module).__name__} was sharded "
            f"with '{param}' in {found} ({len(wrong)} such parameters); a sharded module cannot be converted. "
            f"Build it in {dtype} before fully_shard (Lightning's configure_model runs under a {dtype} default "
            "dtype), or give the strategy a policy so it converts before sharding."
        )
    return False


@contextlib.contextmanager
def gradient_sync_disabled(module: nn.Module) -> Iterator[None]:
    """Backwards inside accumulate locally; the next one outside reduces the
    sum (``set_requires_gradient_sync`` on every unit of ``module``)."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)


def checkpoint_optimizers(
    optimizers: list[torch.optim.Optimizer],
) -> torch.optim.Optimizer | list[torch.optim.Optimizer] | None:
    """What ``save_checkpoint`` / ``load_checkpoint`` take: ``None``, the one
    optimizer, or the list (the same order at save and load)."""
    if not optimizers:
        return None
    return optimizers[0] if len(optimizers) == 1 else list(optimizers)
