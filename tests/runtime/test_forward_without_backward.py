"""A forward with autograd on whose backward never comes (a monitoring loss,
a skipped batch, a dropped output), two forwards before one backward, and
every entry point that may run in between — the next forward, the optimizer
step, clip_grad_norm_, unshard_params, state dicts: parity with a
single-process reference on the global batch, step by step, for every
strategy, activation checkpointing, prefetching, no_sync and CPU offload
(see [Note: held for backward] in composable_shard/runtime/lifecycle.py)."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from composable_shard import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    unshard_params,
)
from composable_shard.runtime.state import TrainingState, unit_states_under
from composable_shard.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from tests.support.harness_pool import requires_cuda, requires_gpus, run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, adamw, assert_resharded, compare_full, hybrid_groups

Shard = Callable[[nn.Module], None]


class _CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under torch.utils.checkpoint."""

    use_reentrant = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.norm(x))


def _checkpointed_gpt(use_reentrant: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = _CheckpointedGPT()
        model.use_reentrant = use_reentrant
        return model

    return build


def _blocks_and_root(**kwargs: object) -> Shard:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    return shard


def _assert_shows_shards(model: nn.Module, when: str) -> None:
    """No unit holds gathered parameters and every parameter the model
    shows is an original one (its shard), not a forward view."""
    assert_resharded(model)
    for name, state in unit_states_under(model):
        assert state.training_state is TrainingState.IDLE, f"{when}: unit '{name}' is {state.training_state.name}"
        for handle in state.handles:
            assert not handle.shows_unsharded_views, f"{when}: unit '{name}' shows forward views"
    for name, param in model.named_parameters():
        assert isinstance(param, nn.Parameter) and param.dim() == 1, f"{when}: '{name}' is not its 1-D shard"


class _Pair:
    """The sharded model on this rank's slice and the reference on the global
    batch, driven together; losses are compared at every forward."""

    def __init__(
        self, build: Callable[[], nn.Module], shard: Shard, device: torch.device, atol: float, rtol: float = 1e-5
    ) -> None:
        torch.manual_seed(0)
        self.model = build().to(device)
        self.reference = copy.deepcopy(self.model)
        shard(self.model)
        self.optimizer = adamw(self.model)
        self.reference_optimizer = adamw(self.reference)
        self.device = device
        self.parity = Parity(build=build, shard=shard, atol=atol, rtol=rtol, reference_optimizer=self.reference_optimizer)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)

    def forward(self, index: int, when: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' losses on batch ``index`` (autograd on), checked equal."""
        inputs, targets = (t.to(self.device) for t in batch(index))
        reference_loss = lm_loss(self.reference(inputs), targets)
        loss = lm_loss(self.model(inputs[self.local]), targets[self.local])
        mean = loss.detach().float()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        torch.testing.assert_close(
            mean, reference_loss.detach(), atol=self.parity.atol, rtol=self.parity.rtol, msg=lambda m: f"{when}: loss {m}"
        )
        return loss, reference_loss

    def backward(self, loss: torch.Tensor, reference_loss: torch.Tensor) -> None:
        loss.backward()
        reference_loss.backward()

    def compare(self, when: str, *, grads: bool) -> None:
        compare_full(self.model, self.reference, self.parity, when, grads=grads)


def _train(pair: _Pair, step: int, *, accumulate: bool) -> None:
    """One step's gradients, with forwards whose backward never comes: one
    forward and its backward, or two forwards then the backward of both or
    of the first only; with ``accumulate``, a micro-batch inside no_sync (a
    dropped forward inside it and one after it) before the synchronised one."""
    when = f"step {step}"
    if accumulate:
        with no_sync(pair.model):
            pair.backward(*pair.forward(10 * step + 1, f"{when} no_sync micro-batch"))
            pair.forward(10 * step + 2, f"{when} dropped inside no_sync")
        pair.forward(10 * step + 3, f"{when} dropped after no_sync")
    kind = step % 3
    first = pair.forward(10 * step, f"{when} first forward")
    if kind == 0:
        pair.backward(*first)
    else:
        second = pair.forward(10 * step + 4, f"{when} second forward")
        if kind == 1:  # two forwards, one backward of both
            pair.backward(first[0] + second[0], first[1] + second[1])
        else:  # two forwards, the backward of the older output only
            pair.backward(*first)


def _forward_without_backward_matches_reference(
    build: Callable[[], nn.Module], shard: Shard, *, device: torch.device, accumulate: bool = False, atol: float = 5e-6
) -> None:
    pair = _Pair(build, shard, device, atol)
    for step in range(3):
        _train(pair, step, accumulate=accumulate)
        _assert_shows_shards(pair.model, f"step {step} after backward")
        pair.compare(f"step {step} after backward", grads=True)
        # Monitoring forwards between backward and step: clipping, then the
        # step, each right after one, must see (and leave) shards.
        pair.forward(100 + step, f"step {step} monitoring forward before clipping")
        norm = clip_grad_norm_(pair.model, 1.0)
        reference_norm = torch.nn.utils.clip_grad_norm_(pair.reference.parameters(), 1.0)
        torch.testing.assert_close(norm, reference_norm, atol=pair.parity.atol, rtol=1e-5)
        pair.forward(150 + step, f"step {step} monitoring forward before the step")
        pair.optimizer.step()
        pair.reference_optimizer.step()
        _assert_shows_shards(pair.model, f"step {step} after optimizer.step")
        pair.optimizer.zero_grad()
        pair.reference_optimizer.zero_grad()
        pair.compare(f"step {step} after optimizer step", grads=False)
        # A skipped batch (forward, no backward, no step), then a change of
        # the parameters no entry point sees: the next forward must see it.
        pair.forward(200 + step, f"step {step} skipped batch")
        with torch.no_grad():
            for param in (*pair.model.parameters(), *pair.reference.parameters()):
                param.mul_(0.99)
    pair.forward(300, "forward after the last step")


def _every_composition_matches_reference(rank: int, world_size: int) -> None:
    cpu = torch.device("cpu")
    cases: dict[str, tuple[Callable[[], nn.Module], Shard, bool]] = {
        "FULL_SHARD": (TinyGPT, _blocks_and_root(strategy=ShardingStrategy.FULL_SHARD), False),
        "SHARD_GRAD_OP": (TinyGPT, _blocks_and_root(strategy=ShardingStrategy.SHARD_GRAD_OP), False),
        "NO_SHARD": (TinyGPT, _blocks_and_root(strategy=ShardingStrategy.NO_SHARD), False),
        "checkpoint": (_checkpointed_gpt(False), _blocks_and_root(), False),
        "checkpoint(use_reentrant=True)": (_checkpointed_gpt(True), _blocks_and_root(), False),
        "forward and backward-pre prefetch": (
            TinyGPT,
            _blocks_and_root(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
            False,
        ),
        "backward-post prefetch": (TinyGPT, _blocks_and_root(backward_prefetch=BackwardPrefetch.BACKWARD_POST), False),
        "no_sync FULL_SHARD": (TinyGPT, _blocks_and_root(), True),
        "no_sync SHARD_GRAD_OP": (TinyGPT, _blocks_and_root(strategy=ShardingStrategy.SHARD_GRAD_OP), True),
        "CPU offload (a no-op on CPU)": (TinyGPT, _blocks_and_root(cpu_offload=CPUOffload(offload_params=True)), False),
    }
    if world_size == 4:
        groups = hybrid_groups(world_size)
        cases = {
            "FULL_SHARD": cases["FULL_SHARD"],
            "HYBRID_SHARD": (TinyGPT, _blocks_and_root(strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups), False),
            "HYBRID_SHARD_ZERO2 no_sync": (
                TinyGPT,
                _blocks_and_root(strategy=ShardingStrategy.HYBRID_SHARD_ZERO2, process_group=groups),
                True,
            ),
        }
    for name, (build, shard, accumulate) in cases.items():
        try:
            _forward_without_backward_matches_reference(build, shard, device=cpu, accumulate=accumulate)
        except Exception as error:
            raise AssertionError(f"case {name}: {error}") from error


@pytest.mark.parametrize("world_size", [2, 4])
def test_forwards_without_backward_train_like_the_reference(world_size: int) -> None:
    run_distributed(_every_composition_matches_reference, world_size)


def _entry_points_after_a_dropped_forward(rank: int, world_size: int) -> None:
    """After a forward with autograd on and no backward, state dicts,
    unshard_params and a direct call of a block see the current full
    parameters (in their own dtype), and what they change reaches the next
    forward."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        for mixed_precision in (None, MixedPrecision(param_dtype=torch.bfloat16)):
            shard = _blocks_and_root(strategy=strategy, mixed_precision=mixed_precision)
            low_precision = mixed_precision is not None
            pair = _Pair(TinyGPT, shard, torch.device("cpu"), atol=5e-2 if low_precision else 5e-6, rtol=1e-2 if low_precision else 1e-5)
            model, reference = pair.model, pair.reference
            full = StateDictOptions(full_state_dict=True)
            case = f"{strategy.name} mixed_precision={mixed_precision is not None}"

            pair.forward(0, f"{case}: dropped forward")
            for key, value in model.state_dict().items():
                torch.testing.assert_close(value, reference.state_dict()[key], atol=0, rtol=0, msg=f"{case}: {key}")
            _assert_shows_shards(model, f"{case}: after state_dict()")

            pair.forward(1, f"{case}: dropped forward")
            for key, value in get_model_state_dict(model, options=full).items():
                torch.testing.assert_close(value, reference.state_dict()[key], atol=0, rtol=0, msg=f"{case}: {key}")
            get_optimizer_state_dict(model, pair.optimizer)
            _assert_shows_shards(model, f"{case}: after get_model_state_dict")

            # A step of an optimizer over other parameters leaves the tree
            # alone; the model's own optimizer ends what it held.
            pair.forward(2, f"{case}: dropped forward")
            torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1).step()
            assert any(
                state.training_state is TrainingState.HELD_FOR_BACKWARD for _, state in unit_states_under(model)
            ), f"{case}: another model's optimizer step released this one"
            pair.optimizer.step()  # no gradients: changes nothing
            _assert_shows_shards(model, f"{case}: after optimizer.step")
            loaded = {key: value * 1.5 for key, value in reference.state_dict().items()}
            model.load_state_dict(loaded)
            reference.load_state_dict(loaded)
            pair.forward(3, f"{case}: forward after load_state_dict")

            loaded = {key: value * 0.5 for key, value in reference.state_dict().items()}
            set_model_state_dict(model, loaded, options=full)
            reference.load_state_dict(loaded)
            pair.forward(4, f"{case}: forward after set_model_state_dict")

            with unshard_params(model):
                for param, expected in zip(model.parameters(), reference.parameters()):
                    torch.testing.assert_close(param, expected, atol=0, rtol=0)
                    with torch.no_grad():
                        param.mul_(2.0)
                        expected.mul_(2.0)
            pair.forward(5, f"{case}: forward after unshard_params")

            if mixed_precision is None:
                pair.forward(6, f"{case}: dropped forward")
                inputs = torch.randn(2, 6, 16)
                with torch.no_grad():
                    torch.testing.assert_close(model.blocks[1](inputs), reference.blocks[1](inputs), atol=5e-6, rtol=1e-5)
            with torch.no_grad():
                pair.forward(7, f"{case}: no-grad forward")
            pair.compare(f"{case}: at the end", grads=False)


def test_entry_points_after_a_forward_without_backward_see_current_parameters() -> None:
    run_distributed(_entry_points_after_a_dropped_forward, 2)


def _cuda_forward_without_backward(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    offload = CPUOffload(offload_params=True)
    for name, shard, accumulate in (
        ("FULL_SHARD", _blocks_and_root(), False),
        ("SHARD_GRAD_OP", _blocks_and_root(strategy=ShardingStrategy.SHARD_GRAD_OP), False),
        ("NO_SHARD", _blocks_and_root(strategy=ShardingStrategy.NO_SHARD), False),
        ("prefetch", _blocks_and_root(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE), False),
        ("CPU offload", _blocks_and_root(cpu_offload=offload), False),
        ("CPU offload SHARD_GRAD_OP no_sync", _blocks_and_root(strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=offload), True),
        ("CPU offload with prefetch", _blocks_and_root(cpu_offload=offload, forward_prefetch=True), False),
    ):
        try:
            _forward_without_backward_matches_reference(TinyGPT, shard, device=device, accumulate=accumulate, atol=2e-5)
        except Exception as error:
            raise AssertionError(f"case {name}: {error}") from error
    torch.cuda.synchronize(device)


@requires_cuda
def test_cuda_forwards_without_backward_train_like_the_reference_on_one_gpu() -> None:
    run_distributed(_cuda_forward_without_backward, 1, backend="nccl")


@requires_gpus(2)
@pytest.mark.parametrize("world_size", [2])
def test_cuda_forwards_without_backward_train_like_the_reference_on_two_gpus(world_size: int) -> None:
    run_distributed(_cuda_forward_without_backward, world_size, backend="nccl")
