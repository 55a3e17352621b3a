"""Owns: what the state-dict functions share in checking what they are
given — ``StateDictError``, the options they accept (``checked_options``),
the messages for a state dict whose keys or values do not fit
(``key_mismatch_message``, ``value_mismatch_message``), and which rank holds
a full state dict (``is_rank0``).

Knows nothing of: units, flat parameters, state-dict values, optimizers,
files; the callers name the function and the keys.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "StateDictError",
    "checked_options",
    "is_rank0",
    "key_mismatch_message",
    "value_mismatch_message",
]

# How many offending names an error message lists before "and N more".
_NAMES_SHOWN = 5


class StateDictError(RuntimeError, ValueError):
    """A state dict (or checkpoint) does not fit the model or optimizer.

    Both a ``RuntimeError`` (what ``nn.Module.load_state_dict`` raises) and a
    ``ValueError`` (a bad argument). Raised before anything is changed."""


def checked_options(options: StateDictOptions | None, what: str, name: str) -> StateDictOptions:
    options = options if options is not None else StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"{what}({name}): options must be a torch.distributed.checkpoint.state_dict.StateDictOptions, "
            f"got {type(options).__name__}."
        )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            f"{what}({name}): broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds a full state "
            "dict). Set both."
        )
    if options.flatten_optimizer_state_dict:
        raise ValueError(
            f"{what}({name}): flatten_optimizer_state_dict=True is not supported. Use the nested optimizer "
            "state dict format (the default)."
        )
    return options


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _names(keys: list[str]) -> str:
    shown = ", ".join(f"'{key}'" for key in keys[:_NAMES_SHOWN])
    return shown + (f" (and {len(keys) - _NAMES_SHOWN} more)" if len(keys) > _NAMES_SHOWN else "")


def key_mismatch_message(what: str, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"Missing key(s) in state_dict: {_names(missing)}.")
    if unexpected:
        parts.append(f"Unexpected key(s) in state_dict: {_names(unexpected)}.")
    hint = (
        " Load a state dict saved from this model, or pass StateDictOptions(strict=False) to load only the keys "
        "both have. Nothing was loaded."
    )
    return f"{what}: the state dict does not match the model. " + " ".join(parts) + hint


def value_mismatch_message(what: str, problems: list[tuple[str, str]]) -> str:
    listed = "; ".join(f"'{key}': {why}" for key, why in problems[:_NAMES_SHOWN])
    more = f" (and {len(problems) - _NAMES_SHOWN} more)" if len(problems) > _NAMES_SHOWN else ""
    return (
        f"{what}: the state dict does not fit the model: {listed}{more}. Load a state dict saved from a model "
        "of the same configuration. Nothing was loaded."
    )
