"""The plan's step as a timeline (``plan.timeline()``): its moments add up
to the plan's numbers, the worst one is the plan's peak; the optimizer in
backward planned (no sharded gradient after the step, a hook moment per
unit); ``plan.plot`` writes a PNG, with a real step's memory sampled at the
hooks (``MemoryRecorder``) drawn over it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import composable_shard as cs
from composable_shard import BackwardPrefetch, CPUOffload, MixedPrecision
from composable_shard.planning.step_replay import OPTIMIZER_STEP
from composable_shard.planning.timeline import CATEGORIES, moment_positions
from composable_shard.runtime import memory_samples

from tests.support.comm_spies import with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, lm_loss

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _meta_gpt(n_blocks: int = 4, dim: int = 64) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(n_blocks=n_blocks, dim=dim, vocab=256)


PLANS = {
    "usual loop": dict(world_size=2, device="cpu"),
    "in backward": dict(world_size=2, device="cpu", optimizer_in_backward=True),
    "one rank in backward": dict(world_size=1, device="cpu", optimizer_in_backward=True),
    "cuda, bf16, prefetch": dict(
        world_size=8,
        device="cuda",
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        forward_prefetch=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    ),
    "offloaded in backward": dict(
        world_size=4, device="cuda", cpu_offload=CPUOffload(offload_params=True), optimizer_in_backward=True
    ),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_timeline_adds_up_to_the_plan_and_peaks_at_its_worst_moment(case: str) -> None:
    planned = cs.plan(_meta_gpt(), policy={Block}, input_shape=(2, 6), **PLANS[case])
    timeline = planned.timeline()
    rb = planned.rank_bytes
    totals = timeline.totals()
    assert len(totals) == len(timeline.moments) == len(planned.moments) > 3 * len(planned.units)
    assert len(timeline.entries) == len(timeline.moments) * len(CATEGORIES)
    # The worst moment is the plan's, its total the plan's total, each of its
    # categories the plan's entry of that meaning.
    assert timeline.peak_moment == planned.peak_moment
    assert max(totals) == totals[timeline.peak_index] == timeline.peak_bytes == rb["total"]
    at_peak = timeline.bytes_at(planned.peak_moment)
    assert at_peak == {category: rb[key] for category, key in CATEGORIES}
    # The model state is there at every moment; the transients move.
    series = timeline.series()
    for category, key in CATEGORIES[:4]:
        assert set(series[category]) == {rb[key]}, category
    assert len(set(totals)) > 3
    # Unit names along the time axis: every unit's forward, then its backward.
    units = [u.name or "<root>" for u in planned.units]
    forward = [timeline.unit_of(m) for m in timeline.moments if m.startswith("forward of") and " after '" not in m]
    backward = [timeline.unit_of(m) for m in timeline.moments if m.startswith("start of backward of")]
    assert forward == units and backward == units[1:][::-1] + ["<root>"]
    # The root's own code after each block (and after the last: the head
    # and the loss) is a moment of the root's, with that block resharded.
    after = [m for m in timeline.moments if m.startswith("forward of") and " after '" in m]
    assert after == [f"forward of '<root>' after '{name}'" for name in units[1:]]
    assert all(timeline.unit_of(m) == "<root>" for m in after)


def test_optimizer_in_backward_keeps_no_gradient_after_the_step() -> None:
    model = _meta_gpt(n_blocks=3)
    numel = sum(p.numel() for p in model.parameters())
    count = len(list(model.parameters()))
    usual = cs.plan(model, world_size=1, policy={Block}, device="cpu")
    stepped = cs.plan(model, world_size=1, policy={Block}, device="cpu", optimizer_in_backward=True)
    # fp32 AdamW: 16 bytes a parameter (+ a step each) in the usual loop, 12 in backward.
    assert usual.rank_bytes["model_state"] == 16 * numel + 4 * count
    assert stepped.rank_bytes["model_state"] == 12 * numel + 4 * count
    assert stepped.rank_bytes["grads"] == 0 and stepped.rank_bytes["total"] < usual.rank_bytes["total"]
    labels = [m.moment for m in stepped.moments]
    assert OPTIMIZER_STEP not in labels and OPTIMIZER_STEP in [m.moment for m in usual.moments]
    hooks = [label for label in labels if label.startswith("optimizer step in backward of")]
    assert [h.split("'")[1] for h in hooks] == ["blocks.2", "blocks.1", "blocks.0", "<root>"]
    # Each hook moment holds its own unit's gradient and one parameter's step
    # temporaries (CPU AdamW: two of the largest parameter and the two
    # scalars of its division, [Note: Adam's single-tensor step, planned]),
    # none of the others'.
    by_label = {m.moment: m for m in stepped.moments}
    root = by_label["optimizer step in backward of '<root>'"]
    assert root.sharded_grads == stepped.units[0].shard_bytes
    assert root.optimizer_step == 2 * max(fp.max_local_numel for fp in stepped.units[0].flat_params) * 4 + 8 + 4
    assert all(m.sharded_grads == 0 for m in stepped.moments if not m.moment.startswith("optimizer step"))
    assert "each freed by the optimizer step in its hooks" in str(stepped)


def test_offloaded_optimizer_in_backward_steps_every_unit_after_backward() -> None:
    # With CPU offload the hooks are deferred to the end of backward: the
    # gradients pile up as in the usual loop and are freed unit by unit.
    planned = cs.plan(
        _meta_gpt(n_blocks=2), world_size=2, policy={Block}, device="cuda",
        cpu_offload=CPUOffload(offload_params=True), optimizer_in_backward=True,
    )
    hooks = [m for m in planned.moments if m.moment.startswith("optimizer step in backward")]
    assert [m.moment for m in planned.moments[-len(hooks):]] == [m.moment for m in hooks]
    grads = [u.bytes_of("grad_bytes") for u in planned.units]
    assert [m.sharded_grads for m in hooks] == [sum(grads), sum(grads[:2]), grads[0]]
    assert planned.rank_bytes["grads"] == 0 and planned.rank_bytes["cpu"] == sum(
        fp.shard_bytes for u in planned.units for fp in u.flat_params
    ) + planned.rank_bytes["optimizer"]


def test_largest_fitting_plans_the_optimizer_in_backward() -> None:
    # Wide blocks: the gradients freed in backward must outweigh what one
    # more unit adds, the runtime's per-unit rest (planning/runtime_memory.py) included.
    def build(n: int) -> TinyGPT:
        return _meta_gpt(n, dim=4096)

    def total(n: int, in_backward: bool) -> int:
        return cs.plan(
            build(n), world_size=2, policy={Block}, device="cpu", optimizer_in_backward=in_backward
        ).rank_bytes["total"]

    budget = total(12, False)
    usual = cs.largest_fitting(build, budget, world_size=2, policy={Block}, device="cpu", high=64)
    stepped = cs.largest_fitting(
        build, budget, world_size=2, policy={Block}, device="cpu", high=64, optimizer_in_backward=True
    )
    assert usual.n == 12 and stepped.n > usual.n
    assert total(stepped.n, True) <= budget < total(stepped.n + 1, True)
    assert stepped.plan is not None and stepped.plan.optimizer_in_backward


def test_plot_writes_a_png_of_the_plan(tmp_path: Path) -> None:
    planned = cs.plan(_meta_gpt(), world_size=2, policy={Block}, device="cpu", input_shape=(2, 6))
    path = tmp_path / "plan.png"
    planned.plot(str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_measured_samples_fall_on_the_plans_moments_in_order() -> None:
    moments = cs.plan(_meta_gpt(n_blocks=2), world_size=2, policy={Block}, device="cpu").timeline().moments
    labels = [
        "pre_forward (<root>)", "pre_forward (blocks.0)", "post_forward (blocks.0)", "pre_forward (blocks.1)",
        "post_forward (blocks.1)", "post_forward (<root>)", "pre_backward (<root>)", "pre_backward (blocks.1)",
        "post_backward (blocks.1)", "pre_backward (blocks.0)", "post_backward (blocks.0)", "post_backward (<root>)",
        "finalize_backward (<root>)", "end of step",
    ]
    where = moment_positions(moments, labels)
    assert where == sorted(where) and len(set(where)) == len(where)
    assert where[1] == moments.index("forward of 'blocks.0'")
    # Small units: blocks.1's gradient is held for a bucket ([Note: coalesced reductions]).
    assert where[8] == moments.index("gradient of 'blocks.1' held for a bucket")
    assert where[-1] == len(moments) - 0.5


@with_collectives_alone  # the root's pre-forward gathers the root only
def _record_a_step(rank: int, world_size: int, out: str) -> dict:
    """One real step recorded at every hook, drawn over the plan; what the
    runtime owned at the root's pre-forward against the plan's numbers."""
    from composable_shard.planning import MemoryRecorder

    recorder = MemoryRecorder()
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, dim=64, vocab=256)
    planned = cs.plan(model, world_size=world_size, rank=rank, policy={Block}, device="cpu", input_shape=(2, 6))
    cs.fully_shard(model, policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    assert memory_samples._sampler is None  # off unless recording
    with recorder.record() as record:
        with pytest.raises(RuntimeError, match="another recording is running"):
            with recorder.record():
                pass
        step()
    assert memory_samples._sampler is None
    step()  # not recorded
    if rank == 0:
        planned.plot(out, measured=record)
    first = record.samples[0]
    return {
        "labels": [s.label for s in record.samples],
        "first_runtime_bytes": first.runtime_bytes,
        # Samples are RSS above the recorder's baseline: a warm worker's heap may
        # serve the step from pages it already holds, so only the level itself
        # (baseline + sample) is sure to be positive.
        "rss": [recorder.baseline + s.bytes for s in record.samples],
        "params": planned.rank_bytes["params"],
        "root_gathered": planned.units[0].bytes_of("unsharded_bytes"),
    }


def test_memory_recorder_samples_every_hook_of_one_step_and_plots_over_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "measured.png"
    results = run_distributed(_record_a_step, 2, str(out))
    for result in results:
        labels = result["labels"]  # type: ignore[index]
        for unit in ("<root>", "blocks.0", "blocks.1"):
            for hook in ("pre_forward", "pre_backward", "post_backward"):
                assert labels.count(f"{hook} ({unit})") == 1, (hook, unit, labels)
        assert labels[0] == "pre_forward (<root>)" and labels[-2:] == ["finalize_backward (<root>)", "end of step"]
        # After the root's pre-forward the runtime owns its shards and the
        # root's gathered buffer, exactly the plan's bytes.
        assert result["first_runtime_bytes"] == result["params"] + result["root_gathered"]  # type: ignore[index]
        assert all(b > 0 for b in result["rss"])  # type: ignore[index]
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_the_package_never_imports_matplotlib_until_a_plot_is_drawn() -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, torch, composable_shard as cs\n"
        "from tests.support.models import Block, TinyGPT\n"
        "planned = cs.plan(TinyGPT(), world_size=2, policy={Block})\n"
        "planned.timeline()\n"
        "assert 'matplotlib' not in sys.modules, 'imported before plot()'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
