"""Owns: everything that touches torch's own functions — the guards on
``torch.autograd.grad`` / ``backward(inputs=)``, on ``Tensor.register_hook``
over original parameters, and torch's ``clip_grad_norm_`` over shards.

Knows nothing of: hooks, files.

These wrappers are installed by the first ``fully_shard`` call, never at
import ([Note: wrapping torch's functions] in ``interop/install.py``).

Layout::

    autograd_grad.py   refuse ``autograd.grad`` over original parameters
    interop/param_hooks.py     refuse gradient hooks on original parameters
    clip_grad.py       torch's clip functions give the global norm
"""
