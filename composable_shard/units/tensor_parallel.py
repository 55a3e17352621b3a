"""Owns: which dimensions of a ``device_mesh`` passed to ``fully_shard`` are
data-parallel when the mesh also carries tensor parallelism, and the
refusal of ``DTensor`` parameters before anything is sharded.

Knows nothing of: how ``DTensor`` parameters are flattened and shown
(``handle/dtensor_views.py``), strategies.

Public names: ``data_parallel_mesh``, ``check_dtensor_params``.

[Note: meshes with a tensor-parallel dimension]
``fully_shard(module, device_mesh=mesh)`` reads a named mesh as follows: a
dimension named "dp" is the one to shard over (``mesh["dp"]``, 1-D); else a
dimension named "tp" is the tensor-parallel one and the others are
data-parallel (a 3-D ``("replicate", "shard", "tp")`` mesh gives the 2-D
``("replicate", "shard")`` mesh of HYBRID sharding). A mesh without those
names is taken as it is (1-D: shard; 2-D: (replicate, shard) for HYBRID).
Pinned by test_two_dimensional_mesh_is_read_by_its_dp_dimension
(tests/tensor_parallel/test_tp_training.py).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..comm import ShardGroups
from ..handle import FlatParamSource
from ..handle.dtensor_views import tensor_parallel_spec

__all__ = ["data_parallel_mesh", "check_dtensor_params", "DATA_PARALLEL_DIM", "TENSOR_PARALLEL_DIM"]

DATA_PARALLEL_DIM = "dp"
TENSOR_PARALLEL_DIM = "tp"


def data_parallel_mesh(mesh: Any) -> Any:
    """The data-parallel part of ``mesh`` (see the note); ``mesh`` itself
    when it names neither dimension."""
    if mesh is None or mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    if DATA_PARALLEL_DIM in names:
        return mesh[DATA_PARALLEL_DIM]
    if TENSOR_PARALLEL_DIM in names:
        others = tuple(name for name in names if name != TENSOR_PARALLEL_DIM)
        return mesh[others[0]] if len(others) == 1 else mesh[others]
    return mesh


def check_dtensor_params(
    name: str, sources: Sequence[FlatParamSource], groups: ShardGroups, keep_low_precision_grads: bool = False
) -> None:
    """Refuse, before ``fully_shard`` changes anything, ``DTensor``
    parameters a flat parameter cannot hold (see ``tensor_parallel_spec``),
    and ``keep_low_precision_grads`` with them (the handle's own check,
    handle/storage.py, would come after earlier units were built)."""
    specs = [
        tensor_parallel_spec(source.param, f"{source.owners[0].fqn}", (groups.shard_group, groups.replicate_group))
        for source in sources
    ]
    if keep_low_precision_grads and any(specs):
        first = next(source for source, spec in zip(sources, specs) if spec is not None)
        raise ValueError(
            f"fully_shard({name}): parameter '{first.owners[0].fqn}' is a DTensor (tensor parallelism); "
            "keep_low_precision_grads=True would give it a plain low-precision .grad, which optimizers "
            "cannot combine with DTensor parameters. Use keep_low_precision_grads=False."
        )
