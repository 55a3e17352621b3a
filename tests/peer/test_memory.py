"""Peak memory of a training step against FSDP1, from the CPU allocator's
profile (live tensor bytes, not RSS): on CPU the backward's worst moment
holds no more than FSDP1's ([Note: backward prefetch on CPU] in
runtime/prefetch.py), and the plan replays that moment."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

import composable_shard as cs
from composable_shard.runtime import hooks as runtime_hooks
from composable_shard.runtime.state import get_state

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, lm_loss

# Blocks dominate: eight of 0.5 MB, a root of 20 KB, activations of a few KB.
DIM, VOCAB, BATCH, SEQ, N_BLOCKS = 128, 32, 2, 6, 8
# Allocations the two libraries make besides parameters and gradients
# (index tensors, small views): far below one block's 0.5 MB.
SLACK_BYTES = 64 * 1024


def _wide_gpt() -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=0, dim=DIM, vocab=VOCAB)
    model.blocks = nn.ModuleList([Block(DIM, 4 * DIM) for _ in range(N_BLOCKS)])
    return model


def _shard_ours(model: nn.Module) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        cs.fully_shard(block)  # the default: BackwardPrefetch.BACKWARD_PRE
    cs.fully_shard(model)
    return model


def _shard_fsdp1(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu")
    )


def _steady_step_peak(shard: Callable[[nn.Module], nn.Module], rank: int) -> int:
    """Peak live tensor bytes over steps 3 to 5 (optimizer state exists,
    gradients were set to None), counted from before the model is built.

    Absolute, not above each step's start: FSDP1 keeps about 2 MB more
    between steps than we do (8.5 against 6.4 MB live at a step's start), so
    "peak above start" compared a smaller excursion from a higher floor and
    flaked under load (FSDP1's excursion varied 1.7-5.6 MB from step to
    step and run to run while its absolute peak stayed 10.2-12.8 MB; ours is
    9.84 MB every time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    gc.disable()  # a collection freeing an earlier model would lower the peak
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = shard(_wide_gpt())
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))

            def step() -> None:
                lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            step()
            with record_function("steady_steps"):
                for _ in range(3):
                    step()
    finally:
        gc.enable()
    events = list(prof.profiler.kineto_results.events())
    window = next(event for event in events if event.name() == "steady_steps")
    live = peak = 0
    for start_ns, delta in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += delta
        if window.start_ns() <= start_ns <= window.end_ns():
            peak = max(peak, live)
    return peak


def _peaks(rank: int, world_size: int) -> dict[str, int]:
    shard: dict[str, Callable[[nn.Module], nn.Module]] = {"fsdp1": _shard_fsdp1, "ours": _shard_ours}
    return {name: _steady_step_peak(wrap, rank) for name, wrap in shard.items()}


def test_step_peak_on_cpu_is_at_most_fsdp1s() -> None:
    # Seen on 2 ranks, quiet and under a load of 16: ours 9.84 MB every run,
    # FSDP1 10.17-13.3 MB. Prefetching at the pre-backward on CPU (the fix in
    # [Note: backward prefetch on CPU]) raises ours to 10.17 MB, inside
    # FSDP1's range, so this peer comparison cannot pin that fix:
    # test_no_other_block_is_gathered_when_a_blocks_gradient_completes_on_cpu
    # does.
    for rank, peaks in enumerate(run_distributed(_peaks, 2, timeout=240)):
        assert peaks["ours"] <= peaks["fsdp1"] + SLACK_BYTES, f"rank {rank}: {peaks}"  # type: ignore[index]


@contextlib.contextmanager
def _gathered_at_post_backward(model: nn.Module, record: list[tuple[str, list[str]]]) -> Iterator[None]:
    """Spy on ``runtime_hooks._post_backward`` (calls through): on entry, the
    unit's gradient is complete, the end of its gradient computation (the
    backward's worst moments), and ``record`` gets the blocks other than
    it whose unsharded buffer is allocated then."""
    real = runtime_hooks._post_backward
    units = [get_state(block) for block in model.blocks]  # type: ignore[union-attr]

    def spy(state: Any, handle: Any, flat_param: torch.Tensor) -> None:
        gathered = [
            unit.fqn
            for unit in units
            if unit is not state and any(h.unsharded_flat_param.untyped_storage().nbytes() > 0 for h in unit.handles)
        ]
        record.append((state.fqn, gathered))
        real(state, handle, flat_param)

    runtime_hooks._post_backward = spy  # type: ignore[assignment]
    try:
        yield
    finally:
        runtime_hooks._post_backward = real  # type: ignore[assignment]


def _gathered_while_a_gradient_completes(rank: int, world_size: int) -> list[tuple[str, list[str]]]:
    model = _shard_ours(_wide_gpt())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    record: list[tuple[str, list[str]]] = []
    for step in range(2):  # the second step keeps the last block gathered from forward
        with _gathered_at_post_backward(model, record) if step == 1 else contextlib.nullcontext():
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
    return record


def test_no_other_block_is_gathered_when_a_blocks_gradient_completes_on_cpu() -> None:
    # Before the fix BACKWARD_PRE (the default) had gathered the next block
    # at this block's pre-backward, so it was alive at every block's worst
    # moment but the first one's.
    for record in run_distributed(_gathered_while_a_gradient_completes, 2, timeout=120):
        blocks = [name for name, _ in record if name.startswith("blocks.")]  # type: ignore[union-attr]
        assert blocks == [f"blocks.{i}" for i in reversed(range(N_BLOCKS))], record
        assert all(gathered == [] for _, gathered in record), record  # type: ignore[union-attr]


def test_plan_on_cpu_prefetches_after_the_reduction() -> None:
    model = _wide_gpt()
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    root_bytes = sum(p.numel() for p in model.parameters()) * 4 - N_BLOCKS * block_bytes
    cpu = cs.plan(model, world_size=2, policy={Block}, device="cpu")
    cuda = cs.plan(model, world_size=2, policy={Block}, device="cuda")
    # CUDA: at the worst moment a block, the block prefetched and the root.
    assert cuda.rank_bytes["unsharded_params"] >= 2 * block_bytes + root_bytes
    # CPU: the prefetch comes after the reduction ([Note: backward prefetch
    # on CPU]), so the worst moment holds one block and the root.
    assert cpu.rank_bytes["unsharded_params"] < 2 * block_bytes
