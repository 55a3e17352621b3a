"""Owns: the refusal of a backward run by compiled autograd.

Knows nothing of: what the hooks do (``runtime/hooks.py`` asks at each
unit's pre-backward), torch.compile of the forward (supported).

Public names: ``refuse_compiled_autograd``.

[Note: compiled autograd]
A unit's gradients are reduced and shown in ``.grad`` by a callback the
first pre-backward queues on autograd's engine (``queue_callback``).
Compiled autograd (``torch._dynamo.compiled_autograd``, turned on by
``torch._dynamo.config.compiled_autograd`` or its ``_enable`` context) runs
the backward as a captured graph and never calls that callback: from the
first compiled backward on, ``.grad`` silently stayed None or unreduced
(FSDP2's test_compiled_autograd_ctx model, 2 ranks; torch's own FSDP2 is
wrong there too on torch 2.13 CPU). So the first pre-backward under it
resets the tree and raises, naming what to do; the model stays usable. It
reads the flag of a module torch imports only once compiled autograd was
set up, so it costs a dictionary lookup otherwise. Pinned by
tests/training/test_compile.py
(test_compiled_autograd_is_refused_and_the_model_trains_after).
"""

from __future__ import annotations

import sys
from typing import Callable

from .state import RootContext

__all__ = ["refuse_compiled_autograd"]

_MODULE = "torch._dynamo.compiled_autograd"


def refuse_compiled_autograd(context: RootContext, unit_fqn: str, reset: Callable[[RootContext], None]) -> None:
    """In a pre-backward of unit ``unit_fqn``: if compiled autograd runs
    this backward, ``reset`` the tree and raise ([Note: compiled autograd])."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return
    # Set while it captures (``_enable``), and while the captured graph,
    # with these hooks in it, is traced and run.
    if not (getattr(module, "compiled_autograd_enabled", False) or getattr(module, "in_compiled_autograd_region", False)):
        return
    reset(context)
    raise RuntimeError(
        f"fully_shard({context.root.fqn}): backward (reaching unit '{unit_fqn}') runs under compiled autograd, "
        "which never calls the end-of-backward callback that reduces the gradients, so .grad would silently "
        "stay unreduced. Turn compiled autograd off (torch._dynamo.config.compiled_autograd = False, or leave "
        "its context); torch.compile of the model's forward is supported. The model has been reset to its "
        "sharded state and is usable."
    )
