"""Units may return any output structure — dataclasses, Hugging Face
``ModelOutput``s, namedtuples, nested dicts and lists with non-tensor leaves,
plain objects, or nothing at all with the result kept on the module — and
train in parity with a single-process reference: backward never reads
parameters resharded after forward. Where no tensor is visible in the output,
the unit keeps its parameters unsharded until the end of backward and warns,
naming the unit (see [Note: outputs without a hookable tensor])."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from composable_shard import fully_shard
from composable_shard.runtime.nested_tensors import scan_output

from tests.support.harness_pool import run_distributed
from tests.support.models import VOCAB, Block
from tests.support.parity import Parity, run_parity


@dataclasses.dataclass
class _DataclassOutput:
    hidden: torch.Tensor
    step: int = 0
    name: str = "block"


_NamedOutput = collections.namedtuple("_NamedOutput", ["hidden", "extra"])


class _AttributeOutput:
    """A plain object: found through its ``__dict__``."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.meta = {"shape": tuple(hidden.shape)}
        self.hidden = hidden


class _SlotsOutput:
    __slots__ = ("hidden",)

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def _model_output_type() -> type:
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class BlockOutput(ModelOutput):
        last_hidden_state: torch.Tensor | None = None
        attentions: tuple | None = None

    return BlockOutput


# Each kind: (pack the block's result, unpack it in the parent).
_Pack = Callable[[nn.Module, torch.Tensor], Any]
_Unpack = Callable[[nn.Module, Any], torch.Tensor]
KINDS: dict[str, tuple[_Pack, _Unpack]] = {
    "dataclass": (lambda m, h: _DataclassOutput(h, 3), lambda m, o: o.hidden),
    "model_output": (lambda m, h: _model_output_type()(last_hidden_state=h), lambda m, o: o.last_hidden_state),
    "namedtuple": (lambda m, h: _NamedOutput(h, None), lambda m, o: o.hidden),
    "nested": (
        lambda m, h: {"layers": [None, ("tag", {"hidden": h, "n": 2})], "ok": True},
        lambda m, o: o["layers"][1][1]["hidden"],
    ),
    "object": (lambda m, h: _AttributeOutput(h), lambda m, o: o.hidden),
    "slots": (lambda m, h: _SlotsOutput(h), lambda m, o: o.hidden),
    # Nothing visible: a closure (opaque), or the result kept on the module.
    "closure": (lambda m, h: (lambda: h), lambda m, o: o()),
    "side_channel": (lambda m, h: m.__dict__.__setitem__("kept", h), lambda m, o: m.__dict__.pop("kept")),
}
HIDDEN_KINDS = ("closure", "side_channel")


class _StructuredBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.block = Block()

    def forward(self, x: torch.Tensor) -> Any:
        return KINDS[self.kind][0](self, self.block(x))


class _StructuredGPT(nn.Module):
    """Embedding, blocks returning ``kind`` structures, head."""

    def __init__(self, kind: str, n_blocks: int = 3) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([_StructuredBlock(kind) for _ in range(n_blocks)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = KINDS[block.kind][1](block, block(x))
        return self.head(x)


def _shard_blocks_and_root(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _every_output_structure_trains_in_parity(rank: int, world_size: int) -> None:
    for kind in KINDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_parity(Parity(build=lambda: _StructuredGPT(kind), shard=_shard_blocks_and_root, steps=2))
        warned = [str(w.message) for w in caught if "returned no tensor that requires grad" in str(w.message)]
        if kind in HIDDEN_KINDS:
            assert warned and "fully_shard(blocks.0)" in warned[0], (kind, warned)
        else:
            assert not warned, (kind, warned)


def test_every_output_structure_trains_in_parity() -> None:
    run_distributed(_every_output_structure_trains_in_parity, 2)


def test_scan_finds_tensors_in_arbitrary_structures_and_reports_opaque_ones() -> None:
    weight = torch.ones(2, requires_grad=True)
    a, b, c = weight * 1, weight * 2, weight * 3
    cycle: list[Any] = [a]
    cycle.append(cycle)
    output = {
        "dc": _DataclassOutput(b),
        "cycle": cycle,
        "obj": _SlotsOutput(c),
        "frozen": torch.ones(2),
        "more": (a, None, 1.5, "x", torch.float32, iter([b])),
    }
    scan = scan_output(output)
    assert {id(t) for t in scan.tensors} == {id(a), id(b), id(c)}
    assert len(scan.tensors) == 3
    assert scan.opaque == ["list_iterator"]
    assert scan_output(torch.ones(1)).tensors == []
    deep: Any = a
    for _ in range(100):
        deep = [deep]
    assert scan_output(deep).tensors == [] and scan_output(deep).opaque == ["list"]

