"""Owns: the state-dict subpackage's public face — the four functions of
``torch.distributed.checkpoint.state_dict``'s shape for a sharded tree.
The checkpoint-directory functions that docs/api.md lists beside them live in
``composable_shard.checkpoint`` (a layer above this one) and are re-exported
at the top level; this face still resolves them by name, lazily, for code
written as ``from composable_shard.state_dict import save_checkpoint``.

Knows nothing of: anything its modules do not (it only re-exports them).

Layout (each module depends only on those above it)::

    range_tensor.py  RangeShardedTensor: a rank's boxes of a parameter, in
                     DCP's tensor protocol
    shards.py        one parameter's range as those boxes; a rank's range
                     read back out of a state-dict value
    checks.py        StateDictError, the options accepted, mismatch messages
    entries.py       the keys every parameter, buffer and extra state goes
                     by (tied aliases included), each parameter's sharding
    model.py         get_model_state_dict / set_model_state_dict
    optim.py         get_optimizer_state_dict / set_optimizer_state_dict
    hooks.py         module.state_dict() / load_state_dict() on units

Directories on disk (save/load, manifest, reader) live in
``composable_shard.checkpoint``, which imports these modules, never this
package face.
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from .range_tensor import RangeShardedTensor
from .checks import StateDictError
from .model import get_model_state_dict, set_model_state_dict
from .optim import get_optimizer_state_dict, set_optimizer_state_dict
import importlib

# Names of the checkpoint wing that this face used to re-export. Resolved on
# first use (PEP 562), so importing state dicts never imports the wing that
# builds on them.
_CHECKPOINT_NAMES = ("save_checkpoint", "load_checkpoint", "CheckpointError", "UnsafeCheckpointError",
                     "DirectFileSystemReader")


def __getattr__(name: str) -> object:
    if name in _CHECKPOINT_NAMES:
        return getattr(importlib.import_module("composable_shard.checkpoint"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
    "StateDictError",
    "RangeShardedTensor",
]
