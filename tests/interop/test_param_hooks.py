"""Gradient hooks on original parameters (``param.register_hook``), which
would never run on a sharded unit: registering one raises at once naming the
parameter and what to use instead; one that got there anyway (before
``fully_shard``, or through ``torch.Tensor.register_hook``) makes the next
forward raise before anything of the step runs; once removed, and after
every refusal, the model trains in parity with the single-process
reference. FULL_SHARD and SHARD_GRAD_OP at 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch
from tests.support.parity import Parity, run_parity


def _double(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


def _shard_and_try_hooks(strategy: ShardingStrategy, refusals: list[str]):
    def shard(model: nn.Module) -> None:
        # Registered before fully_shard: found before the next forward.
        early = model.blocks[1].fc_in.weight.register_hook(_double)
        for block in model.blocks:
            fully_shard(block, strategy=strategy)
        fully_shard(model, strategy=strategy)
        inputs, _ = batch(0, global_batch=2)
        with pytest.raises(RuntimeError, match=r"parameter 'blocks\.1\.fc_in\.weight' has a hook registered") as error:
            model(inputs)
        refusals.append(str(error.value))
        early.remove()

        with pytest.raises(RuntimeError, match=r"register_hook on parameter 'Block\.fc_out\.bias'.*register_post_accumulate_grad_hook") as error:
            model.blocks[0].fc_out.bias.register_hook(_double)
        refusals.append(str(error.value))
        with pytest.raises(RuntimeError, match=r"register_hook on parameter 'TinyGPT\.pos_emb'"):
            model.pos_emb.register_hook(_double)

        # Past the instance attribute, through the class.
        late = torch.Tensor.register_hook(model.norm.weight, _double)
        with pytest.raises(RuntimeError, match=r"parameter 'norm\.weight' has a hook registered"):
            model(inputs)
        late.remove()

    return shard


def _refused_and_training_goes_on(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        refusals: list[str] = []
        # After the refusals (the forward that raised included), every step
        # matches the reference in loss, gradients and parameters.
        run_parity(Parity(build=TinyGPT, shard=_shard_and_try_hooks(strategy, refusals), steps=2))
        assert len(refusals) == 2, refusals


def test_register_hook_on_original_parameter_is_refused_and_model_trains() -> None:
    run_distributed(_refused_and_training_goes_on, 2)
