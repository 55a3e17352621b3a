"""``register_forward_method`` on methods that call the module itself (a
language model's ``generate`` calls ``self(...)`` once a token): a unit's,
a grouped module's and the root's method train or generate exactly like
one process, and a method that raises leaves the model usable
([Note: forward methods] in runtime/hooks.py). Before the fix the inner
``self(...)`` raised "cannot move to FORWARD from FORWARD"."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

from composable_shard import fully_shard, register_forward_method, unshard_params

from tests.support.harness_pool import run_distributed

DIM, BATCH = 8, 4


class _Encoder(nn.Linear):
    def encode(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        hidden = torch.relu(self(x))
        if fail:
            raise RuntimeError("encode failed on purpose")
        return self(hidden)  # the module twice in one method call


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = _Encoder(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc.encode(x))

    @torch.no_grad()
    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = torch.tanh(self(x))
        return x


def _unit(model: _Model) -> None:
    fully_shard(model.enc)
    fully_shard(model)
    register_forward_method(model.enc, "encode")


def _group(model: _Model) -> None:
    fully_shard([model.enc, model.head])
    fully_shard(model)
    register_forward_method(model.enc, "encode")


def _root(model: _Model) -> None:
    fully_shard(model.enc)
    fully_shard(model)
    register_forward_method(model, "generate")
    register_forward_method(model.enc, "encode")


def _max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    with unshard_params(model):
        return max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))


def _train_and_generate(rank: int, world_size: int, shard: Callable[[_Model], None]) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _Model()
    model = copy.deepcopy(reference)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    diffs, generated, raised = [], [], []
    for step in range(3):
        x = torch.randn(BATCH, DIM, generator=generator)
        if step == 1:  # a method that raises after calling the module: the step goes on
            try:
                model.enc.encode(x[rows], fail=True)
            except RuntimeError as error:
                raised.append(str(error))
        reference(x).pow(2).mean().backward()
        model(x[rows]).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        diffs.append(_max_param_diff(model, reference))
        if "generate" in model.__dict__:  # registered on the root
            generated.append(float((model.generate(x[rows], 3) - reference.generate(x[rows], 3)).abs().max()))
    return {"diffs": diffs, "generated": generated, "raised": raised}


def test_forward_methods_that_call_the_module_match_one_process() -> None:
    for shard in (_unit, _group, _root):
        for rank, result in enumerate(run_distributed(_train_and_generate, 2, shard, timeout=120)):
            assert result["raised"] == ["encode failed on purpose"], (shard.__name__, rank, result)
            assert all(diff <= 1e-6 for diff in result["diffs"]), (shard.__name__, rank, result)
            if shard is _root:
                assert len(result["generated"]) == 3 and all(d <= 1e-6 for d in result["generated"]), result
