"""The tensor-parallel recipe of docs/parallelism.md (examples/tensor_parallel_gpt.py): a GPT
whose blocks are parallelised with ColwiseParallel/RowwiseParallel on "tp"
and sharded per block on "dp" of a 2 x 2 mesh trains step by step like one
process on the global batch."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable_shard import unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.parity import StepSlack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel_gpt.py"


def _example():
    spec = importlib.util.spec_from_file_location("tensor_parallel_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _recipe_matches_one_process(rank: int, world_size: int) -> list[float]:
    example = _example()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = example.GPT()
    model = example.parallelize_and_shard(copy.deepcopy(reference), mesh)
    optimizer = torch.optim.AdamW(example.param_groups(model), lr=1e-2, foreach=True)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # Beyond the tolerance, what AdamW's steps amplify of the gradients'
    # round-off ([Note: parity after an adaptive step] in tests/support/parity.py).
    slack = StepSlack()
    losses = []
    for step in range(3):
        tokens = example.batch(step)
        # example.train_step, with each model's full gradients read before its step.
        loss = example.backward(model, example.local_rows(tokens, mesh))
        ref_loss = example.backward(reference, tokens)
        with unshard_params(model, writeback=False, with_grads=True):
            for name, param in model.named_parameters():
                slack.record_grad(name, _full(param.grad), reference.get_parameter(name).grad)
        for each in (optimizer, ref_optimizer):
            each.step()
            each.zero_grad()
        slack.account_steps(reference, ref_optimizer)
        torch.distributed.all_reduce(loss)
        torch.testing.assert_close(loss / world_size, ref_loss, atol=1e-5, rtol=1e-5)
        losses.append(ref_loss.item())
    with unshard_params(model):
        for name, param in model.named_parameters():
            slack.assert_param_close(name, _full(param), reference.get_parameter(name), atol=1e-5, rtol=1e-4, when=name)
    assert isinstance(model.blocks[0].q.weight, DTensor) and not isinstance(model.head.weight, DTensor)
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def test_readme_tensor_parallel_recipe_trains_like_one_process() -> None:
    run_distributed(_recipe_matches_one_process, 4, timeout=300)
