"""Owns: which modules become units and what a unit is built from — the
unit rules shared by ``fully_shard`` and ``plan``, the device-mesh and
tensor-parallel checks, and getting parameters ready to flatten.

Knows nothing of: hooks, streams, state dicts, files.

Layout::

    rules.py            which modules are units, each unit's keyword arguments,
                        which unit owns each parameter, how a unit's parameters
                        group into flat parameters
    units/tensor_parallel.py  the data-parallel dimensions of a mesh; DTensor checks
    materialize.py      meta-device materialisation, moving to the compute
                        device, rank 0's values everywhere, buffer casts
    param_kinds.py      parameters a flat parameter cannot hold, refused by name
    composable_registry.py  units marked in torch's composable-API registry;
                        the modules torch's ``replicate`` manages left to it

The policies themselves are public, in ``composable_shard.policy``.
"""
