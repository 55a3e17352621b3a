"""Owns: one flat parameter: a group of a unit's parameters flattened into
one sharded buffer, gathered for compute and reduced as one gradient.

Knows nothing of: modules' training state, hooks, streams.

The folder, one noun per module, in import order:

- ``dtensor_views.py``: ``DTensor`` (tensor-parallel) parameters: their
  local tensors are what is flattened, and what they show in forward and
  between steps;
- ``writeback.py``: what users changed on their parameters (values,
  ``requires_grad``, a cast) and what is refused;
- ``grads.py``: the sharded gradient once reduced: collected from what the
  user left, accumulated (on the host when offloaded), shown as ``.grad``;
- ``grad_usage.py``: which parameters a backward reached (read off the
  split that cuts the forward views), and the warning for a trainable one
  left without a gradient in a unit that got one;
- ``pending_views.py``: a ``no_sync`` gradient waiting for its reduction
  as ``.grad`` shows it, and what the user did to that ``.grad`` since;
- ``forward_views.py``: the views of the unsharded buffer the owners show
  in forward and backward (cut once per forward, reused by its backward);
- ``storage.py``: ``FlatParamHandle``, the buffers and the parameters'
  views into them; it applies write-back, and reduces gradients through
  ``comm.reduce_grad`` (the reduction's arithmetic lives in
  ``comm/reduction.py``);
- ``full_views.py``: the parameters shown whole outside a step: full
  copies for ``unshard_params`` and state dicts, FSDP2's ``unshard()``
  show and the write-back of edits made there.

Public names: ``FlatParamHandle``, ``FlatParamSource``,
``set_grad_of_other_dtype``.
"""

from __future__ import annotations

from .grads import set_grad_of_other_dtype
from .storage import FlatParamHandle, FlatParamSource

__all__ = ["FlatParamHandle", "FlatParamSource", "set_grad_of_other_dtype"]
