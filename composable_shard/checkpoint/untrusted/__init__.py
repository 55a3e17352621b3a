"""Owns: reading a checkpoint directory as untrusted input — opening only
regular files inside it, reading pickles as data, bounding what a pickle or a
tensor item may allocate, checking DCP metadata, and the direct reader.

Knows nothing of: models, optimizers, state dicts (it reads files).

Layout (each module depends only on those above it)::

    safe_files.py       regular files inside the directory, bounded reads
    pickle_bounds.py    a walk over a pickle's opcodes, building nothing
    safe_pickle.py      pickles read as plain data
    metadata_checks.py  a DCP ``Metadata`` checked before use
    saved_tensor.py     one DCP tensor item at a byte range, checked
    reader.py           ``DirectFileSystemReader``
"""
