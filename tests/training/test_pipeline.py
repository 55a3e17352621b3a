"""Pipeline parallelism composes with fully_shard: a
``torch.distributed.pipelining`` schedule (GPipe and 1F1B) over two stages
whose blocks are units, at 4 ranks = 2 stages x 2 data-parallel ranks
(gloo, CPU: a pipeline group per data-parallel index, a ``fully_shard``
process group per stage), trains in parity with the single-process model
step by step; and a checkpoint saved across that layout (one DCP
checkpoint, each stage writing its part) loads into the single-process
model and into a fresh pipeline layout.

The schedule drives our units as plain modules: one backward per
micro-batch (1F1B runs several forwards before their backwards), each
reducing its gradient into the sharded ``.grad`` (which sums over
micro-batches), then ``scale_grads`` divides by the micro-batch count. The
docs/parallelism.md's recipe, a stage that sets the per-unit controls the schedule sets
on FSDP2's modules (gradient sync, reshard after backward, last backward:
off for every backward but the last), reduces once per unit per step and
gathers less (both counted). A zero-bubble schedule whose stages run
whole backwards (a ``dw_builder`` with an empty weight pass) trains in
parity; its split backward warns at the step."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import (
    fully_shard,
    get_model_state_dict,
    set_is_last_backward,
    set_model_state_dict,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    unshard_params,
)
from torch.distributed.pipelining import PipelineStage

from tests.support.comm_spies import CommSpy, with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.parity import Parity, compare_full, step_and_compare
from tests.support.models import DIM, SEQ, VOCAB, Block, batch

STAGES = 2
DP = 2
GLOBAL_BATCH = 8
MICROBATCHES = 4


class _FirstStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class _PipeGPT(nn.Module):
    """The single-process model: the two stages in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([_FirstStage(), _LastStage()])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.stages[1](self.stages[0](idx))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _layout() -> tuple[int, int, dist.ProcessGroup, dist.ProcessGroup]:
    """(stage, dp index, this stage's data-parallel group, this dp index's
    pipeline group); rank = stage * DP + dp. Every rank makes every group."""
    rank = dist.get_rank()
    stage, dp_index = divmod(rank, DP)
    stage_groups = [dist.new_group([s * DP + d for d in range(DP)]) for s in range(STAGES)]
    pipe_groups = [dist.new_group([s * DP + d for s in range(STAGES)]) for d in range(DP)]
    return stage, dp_index, stage_groups[stage], pipe_groups[dp_index]


def _shard_stage(module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Every block a unit, the last stage's [norm, head] one group, the
    stage the root."""
    for block in module.blocks:
        fully_shard(block, process_group=group)
    if isinstance(module, _LastStage):
        fully_shard([module.norm, module.head], process_group=group)
    return fully_shard(module, process_group=group)


class _Stage(PipelineStage):
    """torch 2.9's schedules start by exchanging a dummy tensor with the
    neighbour stages, sending an int64 scalar into a float32 buffer; gloo
    refuses the size mismatch ("8 vs 4") and aborts the process (fixed in
    torch 2.10, which sends float32). Sending float32 here is a no-op on
    2.10+ (docs/parallelism.md, pipeline recipe)."""

    def _get_init_p2p_neighbors_ops(self):  # type: ignore[no-untyped-def]
        ops = super()._get_init_p2p_neighbors_ops()
        for op in ops:
            op.tensor = op.tensor.to(torch.float32)
        return ops


class _ControlledStage(_Stage):
    """docs/parallelism.md's recipe: torch's schedules set these controls only on
    FSDP2's ``FSDPModule`` (ours are the user's classes), so the stage sets
    them before each micro-batch's backward: every backward but the last
    accumulates locally and keeps the parameters gathered; the last
    reduces the sum once and reshards."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):  # type: ignore[no-untyped-def]
        set_requires_gradient_sync(self.submod, last_backward)
        set_reshard_after_backward(self.submod, last_backward)
        set_is_last_backward(self.submod, last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _make_schedule(kind: str, module: nn.Module, stage: int, pipe_group: dist.ProcessGroup):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    micro = GLOBAL_BATCH // DP // MICROBATCHES
    # Static shapes (docs/parallelism.md's recipe): no metadata inference run.
    # (requires_grad on float tensors: the activations between stages carry
    # gradients back.)
    example_in = torch.zeros(micro, SEQ, dtype=torch.long) if stage == 0 else torch.zeros(micro, SEQ, DIM, requires_grad=True)
    example_out = torch.zeros(micro, SEQ, DIM if stage == 0 else VOCAB, requires_grad=True)
    stage_class = _ControlledStage if kind.endswith("controls") else _Stage
    pipeline_stage = stage_class(
        module, stage, STAGES, torch.device("cpu"), input_args=example_in, output_args=example_out, group=pipe_group
    )
    schedule_class = ScheduleGPipe if kind.startswith("gpipe") else Schedule1F1B
    return schedule_class(pipeline_stage, MICROBATCHES, loss_fn=_loss)


def _record_order(module: nn.Module) -> list[str]:
    """"F" per forward of ``module``, "B" when a backward reaches its output."""
    order: list[str] = []

    def forward_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        order.append("F")
        if output.requires_grad:
            output.register_hook(lambda grad: order.append("B"))

    module.register_forward_hook(forward_hook)
    return order


def _full_values(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    with unshard_params(module, writeback=False):
        return {prefix + name: param.detach().clone() for name, param in module.named_parameters()}


@with_collectives_alone  # counts each unit's collectives
def _pipeline_trains_in_parity(rank: int, world_size: int, root: str) -> None:
    stage, dp_index, stage_group, pipe_group = _layout()
    local = slice(dp_index * GLOBAL_BATCH // DP, (dp_index + 1) * GLOBAL_BATCH // DP)
    all_gathers: dict[tuple[str, int], int] = {}
    for kind in ("gpipe", "1f1b", "gpipe controls", "1f1b controls"):
        torch.manual_seed(0)
        reference = _PipeGPT()
        module = copy.deepcopy(reference.stages[stage])
        _shard_stage(module, stage_group)
        schedule = _make_schedule(kind, module, stage, pipe_group)
        order = _record_order(module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        # Parameters after AdamW within what it amplifies of round-off:
        # [Note: parity after an adaptive step] (tests/support/parity.py).
        parity = Parity(build=_PipeGPT, shard=lambda m: None, reference_optimizer=reference_optimizer)
        for step in range(2):
            inputs, targets = batch(step, GLOBAL_BATCH)
            reference_loss = _loss(reference(inputs), targets)
            reference_loss.backward()
            losses: list[torch.Tensor] = []
            with CommSpy() as spy:
                if stage == 0:
                    schedule.step(inputs[local].contiguous())  # torch 2.9 checks the strides against the static shapes
                else:
                    schedule.step(target=targets[local], losses=losses)
            if kind.startswith("1f1b") and stage == 0:  # two forwards before the first backward
                assert order[:3] == ["F", "F", "B"], order
            order.clear()
            # One reduction per flat parameter (stage 0: 2 blocks and the
            # root's embeddings; stage 1: a block and [norm, head]; its root
            # owns nothing) per micro-batch's backward, or per step with
            # the controls off before the last backward.
            units = 3 if stage == 0 else 2
            reductions = units if kind.endswith("controls") else units * MICROBATCHES
            assert spy.calls.count("reduce_scatter") == reductions, (kind, step, spy.calls)
            all_gathers[kind, step] = spy.calls.count("all_gather_into")
            if kind.endswith("controls"):
                # Parameters kept gathered after every backward but the
                # last: each unit's backwards after the first gather
                # nothing (seen: stage 0 GPipe 22 -> 13, 1F1B 18 -> 9;
                # stage 1 GPipe 15 -> 9, 1F1B 13 -> 7 and 12 -> 6).
                plain = all_gathers[kind.split()[0], step]
                saved = plain - all_gathers[kind, step]
                assert saved == units * (MICROBATCHES - 1), (kind, step, plain, all_gathers[kind, step])
            if stage == 1:
                mean_loss = torch.stack(losses).mean()
                dist.all_reduce(mean_loss, group=stage_group)
                torch.testing.assert_close(mean_loss / DP, reference_loss.detach(), msg=lambda m: f"{kind} step {step} loss: {m}")
            step_and_compare(module, reference.stages[stage], (optimizer, reference_optimizer), parity, f"{kind} step {step}")

    # One checkpoint across the layout: each stage writes its part, by the
    # single-process model's names. What is loaded equals the trained
    # stages exactly (their parity with the reference is checked above).
    prefix = f"stages.{stage}."
    dcp.save({prefix + key: value for key, value in get_model_state_dict(module).items()}, checkpoint_id=root)
    trained: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    dist.all_gather_object(trained, _full_values(module, prefix))
    if rank == 0:  # into the single-process model
        single = _PipeGPT()
        state = {key: value.clone() for key, value in single.state_dict().items()}
        with warnings.catch_warnings():  # DCP's note that no_dist loads in one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=root, no_dist=True)
        single.load_state_dict(state)
        expected = {name: value for values in trained for name, value in values.items()}
        assert sorted(expected) == sorted(name for name, _ in single.named_parameters())
        for name, param in single.named_parameters():
            torch.testing.assert_close(param, expected[name], atol=0, rtol=0, msg=name)
    # Into a fresh pipeline layout (other initial values).
    torch.manual_seed(1)
    fresh = _shard_stage(_PipeGPT().stages[stage], stage_group)
    destination = {prefix + key: value for key, value in get_model_state_dict(fresh).items()}
    dcp.load(destination, checkpoint_id=root)
    set_model_state_dict(fresh, {key[len(prefix):]: value for key, value in destination.items()})
    loaded, saved = _full_values(fresh), _full_values(module)
    assert sorted(loaded) == sorted(saved)
    for name, value in loaded.items():
        torch.testing.assert_close(value, saved[name], atol=0, rtol=0, msg=lambda m: f"loaded checkpoint {name}: {m}")


def test_gpipe_and_1f1b_over_sharded_stages_match_the_single_process_model(tmp_path: Path) -> None:
    run_distributed(_pipeline_trains_in_parity, STAGES * DP, str(tmp_path / "pipeline_checkpoint"))


def _split_backward_warns(rank: int, world_size: int) -> None:
    """[Note: a step after backwards that accumulated nothing]: the split
    backward of the zero-bubble schedules (stage_backward_input, then
    stage_backward_weight over the module's parameters) is not supported:
    its weight gradients stay None, and the optimizer step warns, naming the
    tree. A gradient penalty (autograd.grad over the input, then a backward
    that accumulates) steps without the warning."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from composable_shard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(2, 4, requires_grad=True)
    output = model(inputs)
    _, groups = stage_backward_input([output], [torch.ones_like(output)], [inputs], model.parameters())
    stage_backward_weight(model.parameters(), groups)
    assert all(param.grad is None for param in model.parameters())
    with pytest.warns(UserWarning, match=r"fully_shard\(Sequential\): optimizer\.step\(\) after backwards that computed no gradient.*stage_backward_weight"):
        optimizer.step()

    inputs = torch.randn(2, 4, requires_grad=True)
    output = model(inputs)
    (penalty,) = torch.autograd.grad(output.square().sum(), inputs, create_graph=True)
    (output.sum() + penalty.square().sum()).backward()
    assert all(param.grad is not None for param in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()


def test_split_backward_of_zero_bubble_schedules_warns_at_the_step() -> None:
    run_distributed(_split_backward_warns, 2)


def _no_weight_pass() -> Callable[[], None]:
    """A ``dw_builder`` whose weight pass does nothing: the stage then runs
    each micro-batch's whole backward at its B action (docs/parallelism.md)."""
    return lambda: None


def _zero_bubble_with_whole_backwards_trains_in_parity(rank: int, world_size: int) -> None:
    """[Note: a step after backwards that accumulated nothing] in
    runtime/partial_backward.py: a zero-bubble schedule's split backward
    leaves our weights' gradients None, but with a ``dw_builder`` the stage
    runs torch's whole backward at each B action (our hooks reduce there)
    and the W actions do nothing: ScheduleInterleavedZeroBubble over 4
    stages (two per pipeline rank, looped: rank p holds p and p + 2) x 2
    data-parallel ranks trains in parity with the single-process model.
    (ScheduleZBVZeroBubble trained the same by hand on torch 2.13, and on
    2.11 with the start-up exchange between a rank's own two stages left
    out; torch 2.9 sends the activations between them through gloo, which
    refuses a pair to itself.)"""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    pipe_rank, dp_index, dp_group, pipe_group = _layout()
    local = slice(dp_index * GLOBAL_BATCH // DP, (dp_index + 1) * GLOBAL_BATCH // DP)
    micro = GLOBAL_BATCH // DP // MICROBATCHES
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)) for _ in range(4)])
    owned = (pipe_rank, pipe_rank + STAGES)  # looped: rank 0 holds the first stage, rank 1 the last
    modules = {index: copy.deepcopy(reference[index]) for index in owned}
    stages = []
    for index, module in modules.items():
        fully_shard(module[0], process_group=dp_group)
        fully_shard(module, process_group=dp_group)
        example_in = torch.zeros(micro, DIM, requires_grad=index > 0)
        example_out = torch.zeros(micro, DIM, requires_grad=True)
        stages.append(_Stage(module, index, 4, torch.device("cpu"), input_args=example_in, output_args=example_out,
                             group=pipe_group, dw_builder=_no_weight_pass))
    schedule = ScheduleInterleavedZeroBubble(stages, MICROBATCHES, loss_fn=F.mse_loss)
    parameters = [param for module in modules.values() for param in module.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    parity = Parity(build=lambda: reference, shard=lambda m: None)
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        inputs, targets = torch.randn(GLOBAL_BATCH, DIM, generator=generator), torch.randn(GLOBAL_BATCH, DIM, generator=generator)
        F.mse_loss(reference(inputs), targets).backward()
        losses: list[torch.Tensor] = []
        if pipe_rank == 0:  # the first stage: inputs
            schedule.step(inputs[local].contiguous())
        else:  # the last: targets
            schedule.step(target=targets[local], losses=losses)
        for index, module in modules.items():
            assert all(param.grad is not None for param in module.parameters()), (step, index)
            compare_full(module, reference[index], parity, f"step {step} stage {index}", grads=True)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        for index, module in modules.items():
            compare_full(module, reference[index], parity, f"step {step} stage {index} after SGD", grads=False)


def test_zero_bubble_schedule_with_whole_backwards_matches_the_single_process_model() -> None:
    run_distributed(_zero_bubble_with_whole_backwards_trains_in_parity, STAGES * DP)
