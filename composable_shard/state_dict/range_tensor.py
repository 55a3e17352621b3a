"""Owns: ``RangeShardedTensor``, the value a sharded state dict holds for a
sharded parameter (or per-element optimizer state): a tensor of the
parameter's full shape of which this rank holds the rectangular boxes that
tile its contiguous range, speaking the tensor protocol of
``torch.distributed.checkpoint`` so that ``dcp.save`` / ``dcp.load`` take it
as it is.

Knows nothing of: modules, units, optimizers, collectives (a value is built
from one rank's 1-D range and the layout's ``RangeSharding``).

[Note: DCP tensor protocol]
DCP asks a state-dict value for three hooks before its own type checks (the
protocol DTensor implements, ``torch.distributed._checkpointable``):
``__create_write_items__`` (on save, one SHARD item per box; the coordinator
drops duplicate indices, so replicas write a box once),
``__create_chunk_list__`` (on load, this rank's boxes; DCP reads the overlap
with whatever chunks were saved) and ``__get_tensor_shard__`` (the box as a
view of the rank's range, read when saving and written when loading, so a
load writes straight into the shards). DCP only reaches them for
``torch.Tensor`` instances and compares ``.size()``: hence a wrapper
subclass of the full shape without storage. A rank with no element keeps
the key with no boxes (every rank's state dict has the same keys).
``new_empty`` of its own shape gives the same boxes over a new ``local``
(``dcp.async_save`` stages that way); any other operation raises
``RuntimeError``. Pinned by tests/checkpoint/test_format.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["RangeShardedTensor", "Box"]

# (offsets, sizes, flat start) of one rectangular box of a flattened range.
Box = tuple[tuple[int, ...], tuple[int, ...], int]


class RangeShardedTensor(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds the range ``[start,
    start + local.numel())`` of the row-major flattening, as the rectangular
    ``boxes`` tiling it (views of ``local``). See [Note: DCP tensor protocol].
    """

    # 1-D, this rank's range of the flattened tensor (may be empty).
    local: torch.Tensor
    # Where ``local`` starts in the flattened tensor.
    local_start: int
    # This rank's boxes, in flat order (empty when ``local`` is).
    boxes: tuple[Box, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, local_start: int, boxes: tuple[Box, ...]) -> "RangeShardedTensor":
        value = torch.Tensor._make_wrapper_subclass(  # torch's own API for wrapper subclasses
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        value.local = local
        value.local_start = local_start
        value.boxes = boxes
        return value

    # No torch function handling: only metadata (size, dtype, device) is read.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # stub differs from the base's

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # the base's is a plain function; torch calls a classmethod
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.new_empty.default and list(args[1]) == list(args[0].shape):
            return args[0]._new_empty(**(kwargs or {}))
        # RuntimeError, not TypeError: Python turns a TypeError from a tensor
        # operator (``value + 1``) into NotImplemented and loses this message.
        raise RuntimeError(
            f"composable_shard.state_dict: {func} is not supported on a RangeShardedTensor (one rank's part of a "
            "sharded state dict). Load it with set_model_state_dict / set_optimizer_state_dict or "
            "torch.distributed.checkpoint, read its .local, or ask for StateDictOptions(full_state_dict=True)."
        )

    # The default would run tensor operations.
    def __repr__(self) -> str:  # type: ignore[override]  # takes no tensor_contents: it prints no contents
        return (
            f"RangeShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"local range=[{self.local_start}, {self.local_start + self.local.numel()}), boxes={len(self.boxes)})"
        )

    def _new_empty(
        self,
        dtype: torch.dtype | None = None,
        layout: torch.layout | None = None,
        device: Any = None,
        pin_memory: bool | None = False,
    ) -> "RangeShardedTensor":
        """``new_empty`` of the full shape: the same range and boxes over an
        uninitialised ``local``. ``dcp.async_save`` stages a state dict this
        way (``new_empty`` on the CPU, then a staged copy of ``local`` set
        in), as it does for DTensor."""
        local = torch.empty(
            self.local.shape,
            dtype=dtype or self.local.dtype,
            layout=layout or torch.strided,
            device=device if device is not None else self.local.device,
            pin_memory=bool(pin_memory),
        )
        return RangeShardedTensor(local, self.shape, self.local_start, self.boxes)

    def box_view(self, box: Box) -> torch.Tensor:
        """The plain tensor of one of this rank's boxes (a view of ``local``)."""
        offsets, sizes, flat = box
        begin = flat - self.local_start
        return self.local[begin : begin + math.prod(sizes)].view(sizes)

    # ---------------------------------------------------- the DCP protocol
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for offsets, sizes, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for box in self.boxes:
            if index.offset is not None and torch.Size(box[0]) == index.offset:
                return _owning_alias(self.box_view(box))
        raise ValueError(
            f"composable_shard.state_dict: '{index.fqn}' has no box at offset {index.offset} on this rank "
            f"(its boxes start at {[box[0] for box in self.boxes]})."
        )


# Carrier dtypes numpy knows, by element size (to alias any dtype, bfloat16 included).
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _owning_alias(view: torch.Tensor) -> torch.Tensor:
    """``view`` as a tensor whose storage is exactly its own bytes, aliasing
    the same memory (CPU; elsewhere ``view`` itself).

    [Note: boxes DCP would copy]
    DCP's file writer clones a CPU tensor whose storage is larger than its
    bytes (to avoid writing the whole storage), and torch 2.13's writer keeps
    every tensor of a file alive until the file is done: for our boxes, views
    of the flat shard, that is a second copy of the rank's whole shard during
    ``dcp.save`` (a whole shard more at peak). An alias made through
    numpy has a storage of exactly the box's bytes, so DCP writes it as it is;
    it keeps the shard alive through the array it wraps, and writes into it
    (a load) reach the shard. Measured by scripts/bench.py checkpoint (save
    peak; docs/design/checkpoint.md)."""
    if view.device.type != "cpu" or view.untyped_storage().nbytes() == view.numel() * view.element_size():
        return view
    carrier = _CARRIERS.get(view.element_size())
    if carrier is None or not view.is_contiguous():
        return view
    try:
        return torch.from_numpy(view.view(carrier).numpy()).view(view.dtype).view(view.shape)
    except (RuntimeError, TypeError):  # torch without numpy, or a dtype it cannot view
        return view
