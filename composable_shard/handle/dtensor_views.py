"""Owns: what a flat parameter needs to hold ``DTensor`` parameters (tensor
parallelism on another mesh dimension than the data-parallel one): reading a
parameter's tensor-parallel spec and local tensor, building the forward
``DTensor`` views of the unsharded buffer, and pointing a ``DTensor``
parameter (and its ``.grad``) at a range of the shard.

Knows nothing of: the flat layout's arithmetic, collectives, modules'
training state, hooks.

Public names: ``TensorParallelSpec``, ``tensor_parallel_spec``,
``local_tensor``, ``norm_group_of``, ``forward_view``, ``show_local``, ``show_local_data``, ``as_grad_of``.

[Note: DTensor parameters]
A parameter that is a ``DTensor`` (``parallelize_module`` on a "tp" mesh
dimension) is flattened by its *local* tensor: the layout sees the local
shape, the shard holds a range of the local tensor, and the data-parallel
collectives never see a ``DTensor``. The ``nn.Parameter`` object stays the
user's (identity kept); what it shows:

- inside a unit's forward and backward: ``DTensor.from_local`` of the
  unsharded buffer's view, with the parameter's own mesh, placements, global
  shape and stride, so the parallel styles' forward code runs unchanged and
  autograd's ``from_local`` backward hands the local gradient to the flat
  parameter (a ``Partial`` gradient of a replicated parameter is reduced over
  the tensor-parallel group there, by DTensor);
- outside (between steps): a 1-D ``DTensor`` on the same tensor-parallel
  mesh whose local tensor is this rank's range of the local tensor (a view
  of the shard), placed ``Shard(0)`` when the parameter is sharded on that
  mesh and ``Replicate()`` when it is replicated; its global shape is
  nominal (the range's length times the mesh size for ``Shard(0)``). Its
  ``.grad`` is a ``DTensor`` of the same spec over the sharded gradient. So
  optimizers' per-tensor, foreach and fused paths update the shard through
  DTensor's pointwise rules (every operand has the same spec); read values
  with ``.to_local()``, the whole parameter inside ``unshard_params``;
- inside ``unshard_params``: the full local tensor as a ``DTensor`` with its
  tensor-parallel placements (the same as inside forward).

The switch keeps the object: ``.data`` takes a ``DTensor`` of the new
metadata (shape, stride) and the Python-side ``_local_tensor`` and ``_spec``
are set to the new local view and spec (``.data`` does not reach them).
Pinned by tests/tensor_parallel/test_tp_training.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "TensorParallelSpec",
    "tensor_parallel_spec",
    "local_tensor",
    "norm_group_of",
    "forward_view",
    "show_local",
    "show_local_data",
    "as_grad_of",
]


@dataclass(frozen=True, eq=False)
class TensorParallelSpec:
    """How one ``DTensor`` parameter is distributed on its own mesh."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: torch.Size
    global_stride: tuple[int, ...]
    local_shape: torch.Size

    @property
    def range_placements(self) -> tuple[Placement, ...]:
        """The placements of the 1-D range shown between steps."""
        return tuple(Shard(0) if isinstance(p, Shard) else Replicate() for p in self.placements)

    @property
    def is_sharded(self) -> bool:
        """Whether the tensor-parallel ranks hold different parts of it."""
        return any(isinstance(p, Shard) for p in self.placements)

    def local_offsets(self) -> tuple[int, ...]:
        """Where this rank's local tensor starts in the global tensor."""
        shape, offsets = compute_local_shape_and_global_offset(self.global_shape, self.mesh, self.placements)
        return tuple(offsets)

    def norm_group(self) -> object | None:
        """The group over which this parameter's local parts add up to the
        whole (its mesh's group when sharded; None when replicated: every
        tensor-parallel rank holds the same values, counted once)."""
        return self.mesh.get_group() if self.is_sharded else None


def tensor_parallel_spec(
    param: nn.Parameter, fqn: str, data_parallel_groups: tuple[dist.ProcessGroup | None, ...]
) -> TensorParallelSpec | None:
    """The spec of a ``DTensor`` parameter (None for a plain tensor). Raises
    for what a flat parameter cannot hold: placements other than ``Shard``
    and ``Replicate``, or a mesh that shares ranks with the data-parallel
    groups (``data_parallel_groups``: process groups or None)."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    for placement in param.placements:
        if not isinstance(placement, (Shard, Replicate)) or type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor placed {placement} on its mesh; only Shard(dim) "
                "and Replicate() tensor-parallel placements (ColwiseParallel, RowwiseParallel, "
                "SequenceParallel) can be sharded further. Distribute it with one of those."
            )
    mesh_ranks = set(mesh.mesh.flatten().tolist())
    me = dist.get_rank()
    for group in data_parallel_groups:
        if group is None:
            continue
        overlap = (set(dist.get_process_group_ranks(group)) & mesh_ranks) - {me}
        if overlap:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on a mesh {mesh} that shares ranks "
                f"{sorted(overlap)} with the data-parallel group: data parallelism must run on another mesh "
                "dimension. Pass device_mesh=mesh['dp'] (or a 2-D mesh with a 'dp' dimension) and "
                "parallelize the module on the 'tp' dimension."
            )
    local = param._local_tensor
    return TensorParallelSpec(
        mesh=mesh,
        placements=tuple(param.placements),
        global_shape=param.shape,
        global_stride=tuple(param.stride()),
        local_shape=local.shape,
    )


def norm_group_of(tensor: torch.Tensor) -> object | None:
    """For a tensor no flat parameter holds: the group its local parts add
    up over (a ``DTensor`` sharded on a 1-D mesh), else None."""
    if isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements):
        if tensor.device_mesh.ndim != 1:
            raise ValueError(
                "clip_grad_norm_: a gradient is a DTensor sharded on a multi-dimensional mesh "
                f"{tensor.device_mesh}; give its parameter to fully_shard or clip it separately."
            )
        return tensor.device_mesh.get_group()
    return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a ``DTensor`` (no autograd edge), else ``tensor``."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def forward_view(view: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    """The ``DTensor`` a unit's forward sees: ``view`` (the local tensor,
    an autograd view of the unsharded buffer) with the parameter's
    tensor-parallel spec; differentiable back to ``view``."""
    return DTensor.from_local(
        view, spec.mesh, spec.placements, run_check=False, shape=spec.global_shape, stride=spec.global_stride
    )


def range_dtensor(local: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    """A 1-D range of the local tensor as shown between steps (see the note)."""
    return DTensor.from_local(local.detach(), spec.mesh, spec.range_placements, run_check=False)


def full_dtensor(local: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    """The whole local tensor with its tensor-parallel spec, not differentiable."""
    return forward_view(local.detach(), spec)


def show_local(param: nn.Parameter, shell: DTensor) -> None:
    """Make the ``DTensor`` parameter ``param`` show ``shell`` (its local
    tensor and spec), keeping the object (see the note)."""
    tp_param = cast(DTensor, param)  # nn.Parameter(DTensor) is the DTensor itself, flagged as a parameter
    if tp_param._local_tensor is shell._local_tensor and tp_param._spec is shell._spec:
        return  # already shown (every reshard asks again)
    tp_param.data = shell
    tp_param._local_tensor = shell._local_tensor
    tp_param._spec = shell._spec


def show_local_data(param: nn.Parameter, spec: TensorParallelSpec | None, local: torch.Tensor, *, full: bool) -> None:
    """Point ``param``'s data at ``local``: its range of the shard, or
    (``full``) its whole local tensor; a ``DTensor`` parameter (``spec``
    not None) shows it with its spec (see the note)."""
    if spec is None:
        param.data = local
    elif full:
        show_local(param, full_dtensor(local, spec))
    else:
        show_local(param, range_dtensor(local, spec))


def as_grad_of(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a ``.grad`` for ``param``: a ``DTensor`` of the
    parameter's current spec when it is a ``DTensor``, else ``local``."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
