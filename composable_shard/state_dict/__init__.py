"""Owns: the state-dict subpackage's public face — the four functions of
``torch.distributed.checkpoint.state_dict``'s shape for a sharded tree, and
(re-exported from ``composable_shard.checkpoint``) the checkpoint-directory
functions API.md lists beside them.

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
from ..checkpoint import CheckpointError, DirectFileSystemReader, UnsafeCheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
    "StateDictError",
    "RangeShardedTensor",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "DirectFileSystemReader",
]
