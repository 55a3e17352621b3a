"""Owns: the state-dict and checkpoint subpackage's public face — the four
functions of ``torch.distributed.checkpoint.state_dict``'s shape for a
sharded tree, and the checkpoint helpers built on them.

Knows nothing of: anything its modules do not (it only re-exports them).

Layout (each module depends only on those above it; the imports below
follow this order)::

    range_tensor.py  RangeShardedTensor: a rank's rectangular boxes of a
                     parameter as a tensor that torch.distributed.checkpoint
                     saves and loads through its own tensor protocol (no
                     ShardedTensor)
    shards.py        one parameter's range as those boxes; reading a
                     rank's range back out of a state-dict value
    checks.py        StateDictError, the options accepted, the key and
                     value mismatch messages
    entries.py       the keys every parameter, buffer and extra state goes
                     by, each parameter's sharding, the units made ready
    model.py         get_model_state_dict / set_model_state_dict
    optim.py         get_optimizer_state_dict / set_optimizer_state_dict
    hooks.py         module.state_dict() / load_state_dict() on units
    destinations.py  a checkpoint's DCP metadata checked against the model
                     and optimizer; the state dicts DCP reads into
    files.py         checksums, manifests, the atomic directory switch
    safe_pickle.py   the checkpoint's pickles read as data: .metadata
                     through an allow-list, objects with weights_only
    reader.py        DirectFileSystemReader: DCP's file reader that reads
                     each tensor straight into its destination, and every
                     pickle through safe_pickle.py
    tied_aliases.py  DCP's writer and save planner writing tied aliases once
    convert.py       checkpoint directory <-> torch.save / safetensors file
    checkpoint.py    save_checkpoint / load_checkpoint (safe directories)

Public names: ``get_model_state_dict``, ``set_model_state_dict``,
``get_optimizer_state_dict``, ``set_optimizer_state_dict``,
``StateDictOptions`` (PyTorch's), ``StateDictError``, ``RangeShardedTensor``,
``save_checkpoint``, ``load_checkpoint``, ``CheckpointError``,
``UnsafeCheckpointError``, ``DirectFileSystemReader``, and the helpers
checks.py and entries.py list for the other modules.
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from .range_tensor import RangeShardedTensor
from .checks import StateDictError, checked_options, is_rank0, key_mismatch_message, value_mismatch_message
from .entries import ModelEntries, ShardedParamEntry, is_shown_unsharded, model_entries, prepare_units, sharding_of
from .model import empty_model_state_dict, get_model_state_dict, set_model_state_dict
from .optim import get_optimizer_state_dict, set_optimizer_state_dict
from .safe_pickle import UnsafeCheckpointError
from .reader import DirectFileSystemReader
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
