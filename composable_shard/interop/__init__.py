"""Owns: everything that touches torch's own functions — the guards on
``torch.autograd.grad`` / ``backward(inputs=)``, on ``Tensor.register_hook``
over original parameters, and torch's ``clip_grad_norm_`` over shards — and
when torch's functions are replaced.

Knows nothing of: hooks, files.

torch's module functions are replaced by the first ``fully_shard`` call,
never at import or by ``plan()``, and put back when the last sharded unit is
freed or on request ([Note: wrapping torch's functions] in
``interop/install.py``). Public names: ``set_torch_wrappers(enabled)`` (the
switch; ``False`` keeps ``fully_shard`` from replacing anything),
``uninstall_torch_wrappers()``, ``torch_wrappers_installed()``.
``register_hook`` on an original parameter is refused through an attribute
on that parameter only, never by replacing torch's method.

Layout::

    install.py         when torch's functions are replaced and put back
    autograd_grad.py   refuse ``autograd.grad`` over original parameters
    param_hooks.py     refuse gradient hooks on original parameters
    clip_grad.py       torch's clip functions give the global norm
"""

from .install import set_torch_wrappers, torch_wrappers_installed, uninstall_torch_wrappers

__all__ = ["set_torch_wrappers", "uninstall_torch_wrappers", "torch_wrappers_installed"]
