"""Owns: the state-dict and checkpoint subpackage's public face — the four
functions of ``torch.distributed.checkpoint.state_dict``'s shape for a
sharded tree, and the checkpoint helpers built on them.

Knows nothing of: anything its modules do not (it only re-exports them).

Layout (each module depends only on those above it)::

    shards.py        one parameter's range as rectangular boxes; reading a
                     rank's range back out of a state-dict value
    range_tensor.py  RangeShardedTensor: those boxes as a tensor that
                     torch.distributed.checkpoint saves and loads through
                     its own tensor protocol (no ShardedTensor)
    model.py         get_model_state_dict / set_model_state_dict
    optim.py         get_optimizer_state_dict / set_optimizer_state_dict
    hooks.py         module.state_dict() / load_state_dict() on units
    files.py         checksums, manifests, the atomic directory switch
    safe_pickle.py   the checkpoint's pickles read as data: .metadata
                     through an allow-list, objects with weights_only
    reader.py        DirectFileSystemReader: DCP's file reader that reads
                     each tensor straight into its destination, and every
                     pickle through safe_pickle.py
    checkpoint.py    save_checkpoint / load_checkpoint (safe directories)
    convert.py       checkpoint directory <-> torch.save / safetensors file

The old module paths (``composable_shard.optim_state_dict``,
``.checkpoint``, ``.state_dict_shards``, ``.state_dict_hooks``) re-export
these modules' names.

Public names: ``get_model_state_dict``, ``set_model_state_dict``,
``get_optimizer_state_dict``, ``set_optimizer_state_dict``,
``StateDictOptions`` (PyTorch's), ``StateDictError``, ``RangeShardedTensor``,
``save_checkpoint``, ``load_checkpoint``, ``CheckpointError``,
``UnsafeCheckpointError``, ``DirectFileSystemReader``, and the helpers
model.py lists for the other modules.
"""

from .model import (
    ModelEntries,
    ShardedParamEntry,
    StateDictError,
    StateDictOptions,
    checked_options,
    empty_model_state_dict,
    get_model_state_dict,
    is_rank0,
    is_shown_unsharded,
    key_mismatch_message,
    model_entries,
    prepare_units,
    set_model_state_dict,
    sharding_of,
    value_mismatch_message,
)
from .optim import get_optimizer_state_dict, set_optimizer_state_dict
from .range_tensor import RangeShardedTensor
from .reader import DirectFileSystemReader
from .safe_pickle import UnsafeCheckpointError
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
    "StateDictError",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "RangeShardedTensor",
    "DirectFileSystemReader",
    "ModelEntries",
    "ShardedParamEntry",
    "model_entries",
    "prepare_units",
    "is_shown_unsharded",
    "sharding_of",
    "empty_model_state_dict",
    "checked_options",
    "is_rank0",
    "key_mismatch_message",
    "value_mismatch_message",
]
