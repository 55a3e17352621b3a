"""Owns: the checkpoint subpackage's public face — checkpoint directories on
disk: ``save_checkpoint`` / ``load_checkpoint`` / ``verify_checkpoint``,
``latest_checkpoint`` (the newest complete one under a directory),
``DirectFileSystemReader`` for a plain ``dcp.load``, and the converters to
and from one file of full tensors.

Knows nothing of: anything its modules do not (it only re-exports them).

Layout (each module depends only on those above it, and on
``composable_shard.state_dict``'s modules for the translation between flat
shards and state dicts)::

    errors.py        CheckpointError and the refusals
    safe_files.py    names resolved inside the directory; regular files, sized
    checksums.py     a file's size and checksum, taken while writing or read back
    switch.py        the atomic directory switch, the staging directory
    manifest.py      the manifest; verify_checkpoint; the ranks' agreement
    pickle_bounds.py a pickle's objects, depth and tree size bounded before unpickling
    safe_pickle.py   the checkpoint's pickles read as data
    metadata_checks.py  .metadata's types, exact chunk coverage, byte ranges in files
    refusals.py      the ranks agree on a refusal before anyone writes
    saved_tensor.py  one tensor item described through torch's zip reader
    reader.py        DirectFileSystemReader
    planners.py      DCP planners: tied aliases written once; destinations
                     built from the metadata
    destinations.py  the metadata checked against a model and optimizer
    save_load.py     save_checkpoint / load_checkpoint
    latest.py        latest_checkpoint: the newest complete checkpoint
    convert.py       directory <-> torch.save / safetensors file
"""

from .errors import CheckpointError, UnsafeCheckpointError
from .manifest import MANIFEST_NAME, verify_checkpoint
from .untrusted.reader import DirectFileSystemReader
from .save_load import load_checkpoint, save_checkpoint
from .latest import latest_checkpoint
from .convert import dcp_to_safetensors, dcp_to_torch_save, safetensors_to_dcp, torch_save_to_dcp

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "latest_checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "DirectFileSystemReader",
    "MANIFEST_NAME",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
    "dcp_to_safetensors",
    "safetensors_to_dcp",
]
