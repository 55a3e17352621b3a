"""The label every hook runs under (runtime/labels.py): without a profiler
or debug logging, the cheap path still samples after each hook and logs a
failing hook's rank, unit and state before the exception goes on; with
debug logging each hook logs its label; with the profiler each hook is a
range of the same name."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn as nn

from composable_shard import fully_shard
from composable_shard.runtime import labels, memory_samples
from composable_shard.runtime.state import UnitState

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [record.getMessage() for record in self.records if record.levelno == level]


class _SampleFailure(Exception):
    """What the failing sampler raises."""


def _step(model: nn.Module, step: int) -> None:
    inputs, targets = batch(step)
    lm_loss(model(inputs), targets).backward()


def _labels_sample_log_and_profile(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block})
    logger = logging.getLogger(labels.__name__)
    records = _Records()
    logger.addHandler(records)
    level = logger.level
    try:
        samples: dict[bool, Counter] = {}
        for debug in (False, True):
            logger.setLevel(logging.DEBUG if debug else logging.WARNING)
            counted: Counter = Counter()

            def sample(state: UnitState, hook: str, counted: Counter = counted) -> None:
                counted[hook] += 1

            previous = memory_samples.set_sampler(sample)
            try:
                _step(model, 0)
            finally:
                memory_samples.set_sampler(previous)
            samples[debug] = counted
            # Every hook sampled once per unit, on either path.
            units = 1 + len(model.blocks)  # type: ignore[arg-type]
            assert counted["pre_forward"] == counted["post_forward"] == units, counted
            assert counted["pre_backward"] == counted["post_backward"] == units, counted
            assert counted["finalize_backward"] == 1, counted
            debug_lines = records.messages(logging.DEBUG)
            if debug:
                assert "composable_shard::pre_forward (blocks.0)" in debug_lines, debug_lines[:5]
                assert "composable_shard::post_backward (blocks.1)" in debug_lines, debug_lines[:5]
            else:
                assert debug_lines == [], debug_lines[:5]
            records.records.clear()

            # A hook that fails (here the sample after it) logs rank, unit and
            # state, and its exception goes on unchanged.
            def fail(state: UnitState, hook: str) -> None:
                if hook == "pre_forward" and state.fqn == "blocks.1":
                    raise _SampleFailure(f"sample of {hook} ({state.fqn})")

            previous = memory_samples.set_sampler(fail)
            try:
                _step(model, 1)
                raise AssertionError("the failing sample did not raise")
            except _SampleFailure as error:
                assert str(error) == "sample of pre_forward (blocks.1)", error
            finally:
                memory_samples.set_sampler(previous)
            assert records.messages(logging.ERROR) == [
                f"composable_shard::pre_forward (blocks.1) failed on rank {rank} in state FORWARD"
            ], records.messages(logging.ERROR)
            records.records.clear()
            model.zero_grad()
            _step(model, 2)  # the model still trains
            model.zero_grad()
        assert samples[False] == samples[True], samples

        # With the profiler on, each hook is a range named by its label.
        logger.setLevel(logging.WARNING)
        records.records.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            _step(model, 3)
        names = {event.name for event in profiler.events()}
        assert "composable_shard::pre_forward (blocks.0)" in names, sorted(n for n in names if "composable" in n)
        assert "composable_shard::pre_backward (blocks.1)" in names, sorted(n for n in names if "composable" in n)
        assert records.messages(logging.DEBUG) == []
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def test_hooks_sample_log_failures_and_show_labels_only_when_asked() -> None:
    run_distributed(_labels_sample_log_and_profile, 2)
