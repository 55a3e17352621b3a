"""Resuming twice, as a new user would: save, load into a fresh model, train,
save to the same path, load into another fresh model, train. Every parameter
and every optimizer state (``step`` included) must then follow the run that
never stopped exactly, at world sizes 2 and 4, for AdamW and SGD with
momentum, with parameters smaller than the world size (BufferedGPT's 0-dim
temperature; at 4 ranks the root unit's small norms and biases leave some
ranks with no element of them).

Regression for a rank holding zero elements of a parameter: its ``.grad``
was None, so AdamW never advanced that rank's ``step`` for it, and after one
resume the stale ``step`` could be the one saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composable_shard import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, full_params, make_optimizer, shard, train_steps

FIRST_SAVE, SECOND_SAVE, END = 2, 3, 5


def _full_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        fqn: dict(sorted(values.items()))
        for fqn, values in get_optimizer_state_dict(model, optimizer, options=FULL)["state"].items()
    }


def _fresh(kind: str, how: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = shard(BufferedGPT(), how)
    return model, make_optimizer(kind, model)


def _load(path: str, via: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if via == "safe":
        load_checkpoint(path, model, optimizer)
        return
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def _save(path: str, via: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if via == "safe":
        save_checkpoint(path, model, optimizer)
    else:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def _empty_ranges_exist(model: torch.nn.Module) -> bool:
    """Whether this rank holds zero elements of some parameter."""
    return any(
        info.local_numel == 0
        for _, unit in unit_states_under(model)
        for handle in unit.handles
        for info in handle.layout.params
    )


def _resume_twice(rank: int, world_size: int, root: str) -> list[bool]:
    empty_somewhere = []
    for kind in ("adamw", "sgd"):
        for how, via in (("manual", "dcp"), ("policy", "safe")):
            torch.manual_seed(0)
            model = shard(BufferedGPT(), how)
            optimizer = make_optimizer(kind, model)
            empty_somewhere.append(_empty_ranges_exist(model))
            expected_params, expected_state = {}, {}
            for step in range(END):
                train_steps(model, optimizer, range(step, step + 1))
                expected_params[step] = full_params(model)
                expected_state[step] = _full_optim_state(model, optimizer)

            path = f"{root}/{kind}-{how}-{via}"
            torch.manual_seed(0)
            model = shard(BufferedGPT(), how)
            optimizer = make_optimizer(kind, model)
            train_steps(model, optimizer, range(FIRST_SAVE))
            _save(path, via, model, optimizer)
            for start, stop in ((FIRST_SAVE, SECOND_SAVE), (SECOND_SAVE, END)):
                model, optimizer = _fresh(kind, how)
                _load(path, via, model, optimizer)
                for step in range(start, stop):
                    train_steps(model, optimizer, range(step, step + 1))
                    what = f"{kind} {how} {via}: resumed at {start}, step {step}"
                    assert_same_tensors(full_params(model), expected_params[step], f"{what} params")
                    assert_same_tensors(_full_optim_state(model, optimizer), expected_state[step], f"{what} optimizer state")
                if stop != END:
                    _save(path, via, model, optimizer)  # the same path, overwritten
    return empty_somewhere


@pytest.mark.parametrize("world_size", [2, 4])
def test_resuming_twice_follows_the_uninterrupted_run_exactly(world_size: int, tmp_path: Path) -> None:
    empty = run_distributed(_resume_twice, world_size, str(tmp_path))
    # The layouts must include the case under test: a rank with an empty range.
    assert any(flag for rank_flags in empty for flag in rank_flags)
