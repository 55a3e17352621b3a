"""Owns: what a user calls on a sharded tree between or around steps — the
per-unit runtime controls (FSDP2's ``FSDPModule`` methods as functions),
the reduction controls, and ``unshard_params`` / ``no_sync`` /
``clip_grad_norm_``.

Knows nothing of: the hooks' internals (it calls the runtime's gate and the
units' state methods), files.

Layout::

    per_unit.py        gradient sync, the last backward, resharding, prefetch
                       lists, ``unshard`` / ``reshard``
    reduction.py       ``set_requires_all_reduce``, ``set_gradient_divide_factor``,
                       ``register_comm_hook``, ``set_all_reduce_hook``
    unshard_params.py  ``unshard_params``, ``no_sync``, ``clip_grad_norm_``

Public names are re-exported at the top level of ``composable_shard``.
"""
