"""When torch's own functions are replaced ([Note: wrapping torch's functions]
in composable_shard/interop/install.py): ``import composable_shard`` and
``plan()`` replace nothing (identity with torch's objects); the first
``fully_shard`` installs the wrappers; ``uninstall_torch_wrappers()`` and
freeing the last sharded model put torch's objects back;
``set_torch_wrappers(False)`` keeps ``fully_shard`` from installing them and
the model still trains (with ``composable_shard.clip_grad_norm_``); a torch
whose private ``clip_grad._get_total_norm`` is missing, computes another
norm, or is no longer what ``clip_grad_norm_`` calls refuses the first
``fully_shard`` naming the torch version and the name, leaves the module
untouched, and the model trains once torch is whole.

The first three run each in a fresh Python process (a warm test worker may
already hold sharded models of earlier tests); the refusals at 2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.clip_grad as torch_clip_grad

from composable_shard import ShardingStrategy, fully_shard, is_fully_sharded
from composable_shard.interop import set_torch_wrappers, torch_wrappers_installed, uninstall_torch_wrappers

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, plain_step, run_parity, shard_manually
from tests.support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]

# Run first in every script: torch's objects, taken before composable_shard
# is imported, and which of them differ now.
_PRELUDE = """
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as torch_clip_grad


def torch_functions():
    return {
        "torch.autograd.grad": torch.autograd.grad,
        "torch.autograd.backward": torch.autograd.backward,
        "torch.Tensor.backward": torch.Tensor.backward,
        "torch.nn.utils.clip_grad._get_total_norm": torch_clip_grad._get_total_norm,
        "torch.nn.utils.get_total_norm": torch.nn.utils.get_total_norm,
        "torch.nn.utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "torch.nn.utils.clip_grad.clip_grad_norm_": torch_clip_grad.clip_grad_norm_,
        "torch.nn.utils.clip_grad_norm": torch.nn.utils.clip_grad_norm,
        "torch.nn.utils.clip_grads_with_norm_": torch.nn.utils.clip_grads_with_norm_,
        "torch.nn.utils.clip_grad_value_": torch.nn.utils.clip_grad_value_,
    }


ORIGINAL = torch_functions()
WRAPPED = [
    "torch.autograd.backward",
    "torch.autograd.grad",
    "torch.nn.utils.clip_grad._get_total_norm",
    "torch.nn.utils.get_total_norm",
]


def replaced():
    \"\"\"The names whose object is not torch's own now.\"\"\"
    return sorted(name for name, function in torch_functions().items() if function is not ORIGINAL[name])


import composable_shard
from composable_shard import ShardingStrategy, clip_grad_norm_, fully_shard, interop
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, plain_step, run_parity, shard_manually

assert replaced() == [], f"import composable_shard replaced {replaced()}"
assert not interop.torch_wrappers_installed()


def init_group(port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""


def _run_script(body: str) -> None:
    """Run the prelude and ``body`` in a fresh Python process; it must print
    ``done`` last."""
    script = _PRELUDE + body.replace("{PORT}", str(free_ports(1)[0])) + "\nprint('done')\n"
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.strip().splitlines()[-1] == "done", completed.stdout[-2000:]


_IMPORT_AND_PLAN = """
with torch.device("meta"):
    meta_model = TinyGPT()
sharding_plan = composable_shard.plan(meta_model, world_size=8, policy={type(meta_model.blocks[0])})
assert sharding_plan is not None
assert replaced() == [], f"plan() replaced {replaced()}"
assert not interop.torch_wrappers_installed()

# Plain torch code runs torch's own functions (the same objects, so the same
# bits at the same speed).
x = torch.arange(4.0, requires_grad=True)
(grad,) = torch.autograd.grad((x**3).sum(), x)
assert torch.equal(grad, 3 * x.detach() ** 2)
(x**2).sum().backward()
assert torch.equal(x.grad, 2 * x.detach())
"""


def test_import_and_plan_replace_none_of_torchs_functions() -> None:
    _run_script(_IMPORT_AND_PLAN)


_INSTALL_AND_UNINSTALL = """
init_group({PORT})
plain = [torch.tensor([3.0, -4.0]), torch.tensor([12.0])]

model = TinyGPT()
shard_manually(ShardingStrategy.FULL_SHARD)(model)
assert replaced() == WRAPPED, replaced()
assert interop.torch_wrappers_installed()
for name in WRAPPED:
    assert torch_functions()[name].__wrapped__ is ORIGINAL[name], name
# Tensors of no unit: torch's own results.
for norm_type in (2.0, math.inf):
    assert torch.equal(
        torch.nn.utils.get_total_norm(plain, norm_type),
        ORIGINAL["torch.nn.utils.get_total_norm"](plain, norm_type),
    )
x = torch.arange(4.0, requires_grad=True)
(grad,) = torch.autograd.grad((x**3).sum(), x)
assert torch.equal(grad, 3 * x.detach() ** 2)
# The guard is on.
inputs, targets = batch(0, global_batch=2)
with pytest.raises(RuntimeError, match=r"torch.autograd.grad with parameter 'TinyGPT\\.pos_emb'"):
    torch.autograd.grad(lm_loss(model(inputs), targets), list(model.parameters()))

bound_grad = torch.autograd.grad  # a wrapper someone holds
interop.uninstall_torch_wrappers()
assert replaced() == [], replaced()
assert not interop.torch_wrappers_installed()
interop.uninstall_torch_wrappers()  # nothing left to put back
assert replaced() == []
(grad,) = bound_grad((x**3).sum(), x)  # still works, calling torch's own
assert torch.equal(grad, 3 * x.detach() ** 2)


def clip_with_torch(model, inputs, targets):
    loss = plain_step(model, inputs, targets)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    return loss


# The next fully_shard installs them again, and torch's clipping is global.
run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD), steps=2,
                  step_fn=clip_with_torch, reference_step_fn=clip_with_torch))
assert replaced() == WRAPPED, replaced()  # `model` is alive

# The last sharded unit freed: torch's own again.
del model
gc.collect()
assert replaced() == [], f"after the last sharded model was freed: {replaced()}"
assert not interop.torch_wrappers_installed()
model = TinyGPT()
shard_manually(ShardingStrategy.SHARD_GRAD_OP)(model)
assert replaced() == WRAPPED, replaced()
del model
gc.collect()
assert replaced() == []
dist.destroy_process_group()
"""


def test_first_fully_shard_installs_and_uninstall_or_freeing_restores_torchs_functions() -> None:
    _run_script(_INSTALL_AND_UNINSTALL)


_SWITCHED_OFF = """
init_group({PORT})
interop.set_torch_wrappers(False)


def clip_with_ours(model, inputs, targets):
    loss = plain_step(model, inputs, targets)
    clip_grad_norm_(model, 0.05)
    return loss


def reference_clip(model, inputs, targets):
    loss = plain_step(model, inputs, targets)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    return loss


def shard_and_check(model):
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    assert replaced() == [], f"fully_shard with the wrappers switched off replaced {replaced()}"


# Switched off: fully_shard replaces nothing, and the model trains in parity
# with composable_shard.clip_grad_norm_.
run_parity(Parity(build=TinyGPT, shard=shard_and_check, steps=2, step_fn=clip_with_ours,
                  reference_step_fn=reference_clip))
model = TinyGPT()
shard_manually(ShardingStrategy.FULL_SHARD)(model)
assert replaced() == []
with pytest.raises(TypeError, match=r"set_torch_wrappers: enabled must be True or False, got 'no'"):
    interop.set_torch_wrappers("no")
assert replaced() == []
# On again with a sharded model alive: installed at once; off: put back.
interop.set_torch_wrappers(True)
assert replaced() == WRAPPED, replaced()
interop.set_torch_wrappers(False)
assert replaced() == []
interop.set_torch_wrappers(True)
del model
gc.collect()
assert replaced() == [], replaced()
dist.destroy_process_group()
"""


def test_set_torch_wrappers_false_keeps_fully_shard_from_replacing_anything() -> None:
    _run_script(_SWITCHED_OFF)


# ---------------------------------------------------------------- refusals
def _wrong_norm(tensors: object, norm_type: float = 2.0, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.tensor(0.0)


def _clip_without_get_total_norm(parameters: object, max_norm: float, norm_type: float = 2.0, *args: object, **kwargs: object) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]  # type: ignore[attr-defined]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)


_MISSING = object()

# (what is wrong, the attribute of torch.nn.utils.clip_grad to set, its value
# (_MISSING: deleted), what the message must say)
_BROKEN_TORCH: list[tuple[str, str, object, str]] = [
    ("missing", "_get_total_norm", _MISSING, r"has no torch\.nn\.utils\.clip_grad\._get_total_norm"),
    ("wrong norm", "_get_total_norm", _wrong_norm, r"gives tensor\(0\.\) as the 2\.0-norm of \[3, -4\] and \[12\] \(expected 13\.0\)"),
    ("not called", "clip_grad_norm_", _clip_without_get_total_norm, r"clip_grad_norm_ that no longer calls torch\.nn\.utils\.clip_grad\._get_total_norm"),
]


def _with_broken_torch(attribute: str, value: object, action: Callable[[], object]) -> None:
    """Run ``action`` with ``torch.nn.utils.clip_grad.<attribute>`` set to
    ``value`` (deleted for _MISSING): a torch release that changed it."""
    original = getattr(torch_clip_grad, attribute)
    if value is _MISSING:
        delattr(torch_clip_grad, attribute)
    else:
        setattr(torch_clip_grad, attribute, value)
    try:
        action()
    finally:
        setattr(torch_clip_grad, attribute, original)


def _refused_then_trains(refusals: list[str]) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        torch_functions = (torch.autograd.grad, torch.autograd.backward, torch.nn.utils.get_total_norm)
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        for what, attribute, value, message in _BROKEN_TORCH:

            def refused_fully_shard() -> None:
                with pytest.raises(RuntimeError, match=message) as error:
                    fully_shard(model.get_submodule("blocks.0"))
                refusals.append(str(error.value))

            _with_broken_torch(attribute, value, refused_fully_shard)
            assert not torch_wrappers_installed(), what
            assert (torch.autograd.grad, torch.autograd.backward, torch.nn.utils.get_total_norm) == torch_functions, what
            assert not any(is_fully_sharded(module) for module in model.modules()), f"{what}: module changed"
            for name, param in model.named_parameters():
                assert torch.equal(param, before[name]), f"{what}: {name} changed"
        # torch whole again: sharding works and installs the wrappers.
        shard_manually(ShardingStrategy.FULL_SHARD)(model)
        assert torch_wrappers_installed()
        # Switching on again with a sharded model and a broken torch is
        # refused too, and changes nothing.
        uninstall_torch_wrappers()

        def refused_switch() -> None:
            with pytest.raises(RuntimeError, match=r"set_torch_wrappers\(True\): torch .* has no torch\.nn\.utils\.clip_grad\._get_total_norm"):
                set_torch_wrappers(True)

        _with_broken_torch("_get_total_norm", _MISSING, refused_switch)
        assert not torch_wrappers_installed()
        set_torch_wrappers(True)
        assert torch_wrappers_installed()

    return shard


def _clip_with_torch(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = plain_step(model, inputs, targets)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    return loss


def _broken_torch_refuses_first_fully_shard(rank: int, world_size: int) -> None:
    uninstall_torch_wrappers()  # as in a process whose first fully_shard comes now
    refusals: list[str] = []
    run_parity(
        Parity(build=TinyGPT, shard=_refused_then_trains(refusals), steps=2, step_fn=_clip_with_torch,
               reference_step_fn=_clip_with_torch)
    )
    assert len(refusals) == len(_BROKEN_TORCH), refusals
    for refusal in refusals:
        assert refusal.startswith(f"fully_shard(Block): torch {torch.__version__} "), refusal
        assert "set_torch_wrappers(False)" in refusal and "Nothing was changed." in refusal, refusal


def test_a_torch_without_the_private_clip_name_refuses_the_first_fully_shard() -> None:
    run_distributed(_broken_torch_refuses_first_fully_shard, 2)
