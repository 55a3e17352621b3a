"""Owns: which parameters a flat parameter can hold — the refusal, before
anything is sharded, of the others by name: tensor subclasses other than
``DTensor``, sparse, nested and quantized tensors, and lazy modules'
uninitialised parameters, and a ``grad_dtype`` other than the parameter's.

Knows nothing of: units, process groups, storage (``units/rules.py`` calls
it for each parameter it gives a new unit).

Public names: ``check_flattenable``.

[Note: parameters a flat parameter cannot hold]
A flat parameter is one strided 1-D buffer per dtype; each parameter
becomes a plain strided view of it. A parameter that is not a plain
strided dense tensor loses what it is there. A tensor subclass
(``TwoTensor``, torchao's NF4 or float8 weights, a ``__torch_function__``
subclass) would be copied into the buffer through its own dispatch (for
``TwoTensor``, each inner tensor in turn, the last one winning) and show
plain views from then on: its own arithmetic silently gone, the original
object no longer the buffer's (edits and ``unshard_params`` lost; seen on
FSDP2's test_all_gather_extensions_train_parity model). Sparse, nested
and quantized tensors and ``UninitializedParameter`` raised torch's own
errors part-way through sharding. So each is refused with its name,
what it is and what to do, before ``fully_shard`` (or ``plan``) changes
anything. ``nn.Parameter`` subclasses over plain tensors are plain
parameters here (their objects are kept, as every parameter's), and
``DTensor`` parameters go to ``units/tensor_parallel.py``. Pinned by
tests/runtime/test_errors.py
(test_parameters_a_flat_parameter_cannot_hold_are_refused_by_name).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parameter import UninitializedParameter

from ..handle.grads import refuse_grad_dtype

__all__ = ["check_flattenable"]


def check_flattenable(name: str, fqn: str, param: torch.Tensor) -> None:
    """Raise naming ``fqn`` (in ``fully_shard(name)``) if a flat parameter
    cannot hold ``param`` ([Note: parameters a flat parameter cannot hold])."""
    what = _unflattenable_kind(param)
    if what is None:
        refuse_grad_dtype(param, fqn, name)  # [Note: a parameter's grad_dtype] in handle/grads.py
        return
    raise ValueError(
        f"fully_shard({name}): parameter '{fqn}' is {what}, which a flat parameter cannot hold (each "
        "parameter becomes a plain dense view of one buffer). Keep its module out with "
        "ignored_states=[module] (left as it is: whole on every rank, its gradient not reduced by "
        "fully_shard), or make it a plain dense tensor before fully_shard."
        + (" Run one forward first so the lazy module creates it." if isinstance(param, UninitializedParameter) else "")
    )


def _unflattenable_kind(param: torch.Tensor) -> str | None:
    if isinstance(param, UninitializedParameter):
        return "an uninitialised parameter of a lazy module"
    if isinstance(param, DTensor):
        return None
    if not issubclass(type(param), nn.Parameter) and type(param) is not torch.Tensor:
        # nn.Parameter(t) of a tensor subclass is that subclass, marked as a parameter.
        return f"a tensor subclass ({type(param).__name__})"
    if param.is_nested:
        return "a nested tensor"
    if param.is_quantized:
        return "a quantized tensor"
    if param.layout != torch.strided:
        return f"a {str(param.layout).removeprefix('torch.')} tensor"
    return None
