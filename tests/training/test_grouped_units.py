"""Grouped units, ``fully_shard([module_a, module_b, ...])``: several modules
form one unit (one flat parameter per dtype and trainability) gathered
before the first of them runs and resharded and reduced after the last.
Parity with the single-process model step by step (torchtitan's
``[norm, output]`` group, a tied embedding and head in one group, FSDP2's
"mem_eff" activation-checkpointing groupings), one all-gather per group per
forward, what a group manages (FSDP2's list-of-modules init tests), and
the errors of a bad group."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import composable_shard as cs
from composable_shard import ShardingStrategy, fully_shard, is_fully_sharded
from composable_shard.runtime.state import get_state

from tests.support.comm_spies import CommSpy, with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import MLP, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, run_parity


def _untied_gpt() -> nn.Module:
    """TinyGPT with its own head weight (torchtitan's untied output)."""
    model = TinyGPT()
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    return model


class _NormCheckpointGPT(TinyGPT):
    """Runs its final norm (a member of the [norm, head] group) under
    activation checkpointing."""

    use_reentrant = False

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = nn.Parameter(self.tok_emb.weight.detach().clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(checkpoint(self.norm, x, use_reentrant=self.use_reentrant))


def _norm_checkpoint_gpt(use_reentrant: bool) -> nn.Module:
    model = _NormCheckpointGPT()
    model.use_reentrant = use_reentrant
    return model


def _torchtitan_groups(strategy: ShardingStrategy, mesh_shape: tuple[int, int] | None = None):
    """Blocks, then ``[norm, head]`` as one unit, then the root; with
    ``mesh_shape`` on a (replicate, shard) mesh made in the worker."""

    def shard(model: nn.Module) -> None:
        kwargs = dict(strategy=strategy)
        if mesh_shape is not None:
            kwargs["device_mesh"] = init_device_mesh("cpu", mesh_shape)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard([model.norm, model.head], **kwargs)
        fully_shard(model, **kwargs)

    return shard


def _tied_group(strategy: ShardingStrategy):
    """The tied embedding and head (and the norm) in one group."""

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy)
        fully_shard([model.tok_emb, model.norm, model.head], strategy=strategy)
        fully_shard(model, strategy=strategy)

    return shard


def _mem_eff(model: nn.Module) -> None:
    """FSDP2's "mem_eff" grouping on a 3-block model: block 0 alone, blocks
    1 and 2 as one group, [norm, head] kept gathered (SHARD_GRAD_OP), every
    block under composable activation checkpointing."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for block in model.blocks:
        composable_checkpoint(block)
    fully_shard(model.blocks[0])
    fully_shard([model.blocks[1], model.blocks[2]])
    fully_shard([model.norm, model.head], strategy=ShardingStrategy.SHARD_GRAD_OP)
    fully_shard(model)


def _mem_eff_weight_tied(model: nn.Module) -> None:
    """FSDP2's "mem_eff_weight_tied": [embedding, head] (tied) as one group,
    each block its own unit under composable checkpointing."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    fully_shard([model.tok_emb, model.head])
    for block in model.blocks:
        composable_checkpoint(block)
        fully_shard(block)
    fully_shard(model)


def _groups_match_reference(rank: int, world_size: int) -> None:
    cases = {
        "[norm, head] FULL_SHARD": (_untied_gpt, _torchtitan_groups(ShardingStrategy.FULL_SHARD)),
        "[norm, head] SHARD_GRAD_OP": (_untied_gpt, _torchtitan_groups(ShardingStrategy.SHARD_GRAD_OP)),
        "[norm, head] NO_SHARD": (_untied_gpt, _torchtitan_groups(ShardingStrategy.NO_SHARD)),
        "tied [tok_emb, norm, head] FULL_SHARD": (TinyGPT, _tied_group(ShardingStrategy.FULL_SHARD)),
        "tied [tok_emb, norm, head] SHARD_GRAD_OP": (TinyGPT, _tied_group(ShardingStrategy.SHARD_GRAD_OP)),
        "checkpointed norm in [norm, head]": (
            functools.partial(_norm_checkpoint_gpt, False), _torchtitan_groups(ShardingStrategy.FULL_SHARD)
        ),
        "reentrant checkpointed norm in [norm, head]": (
            functools.partial(_norm_checkpoint_gpt, True), _torchtitan_groups(ShardingStrategy.FULL_SHARD)
        ),
        "mem_eff": (_untied_gpt, _mem_eff),
        "mem_eff_weight_tied": (TinyGPT, _mem_eff_weight_tied),
    }
    for name, (build, shard) in cases.items():
        parity = Parity(build=build, shard=shard)
        try:
            run_parity(parity)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
        # named_parameters names a tied head weight "tok_emb.weight".
        assert {"tok_emb.weight", "norm.weight"} <= set(parity.compared), name


def test_grouped_units_train_in_parity_with_the_single_process_model() -> None:
    run_distributed(_groups_match_reference, 2)


def _hybrid_groups_match_reference(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
        try:
            run_parity(Parity(build=_untied_gpt, shard=_torchtitan_groups(strategy, (2, 2)), steps=2))
        except AssertionError as error:
            raise AssertionError(f"{strategy.name}: {error}") from error


def test_grouped_units_under_hybrid_sharding_train_in_parity() -> None:
    run_distributed(_hybrid_groups_match_reference, 4)


@with_collectives_alone  # counts each unit's all-gathers
def _one_all_gather_per_group_per_forward(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        torch.manual_seed(0)
        model = _untied_gpt()
        _torchtitan_groups(strategy)(model)
        group = get_state(model.norm)
        assert group is get_state(model.head) and len(group.handles) == 1
        inputs, targets = batch(0, 2)
        for step in range(2):
            with CommSpy() as spy:
                logits = model(inputs)
            # 3 blocks + the group + the root: one flat parameter each.
            assert spy.calls.count("all_gather_into") == 5, (strategy, step, spy.calls)
            lm_loss(logits, targets).backward()
            assert_resharded(model)
        with torch.no_grad(), CommSpy() as spy:
            model(inputs)
        assert spy.calls.count("all_gather_into") == 5, (strategy, "no_grad", spy.calls)
        assert_resharded(model)


def test_a_group_is_gathered_once_per_forward() -> None:
    run_distributed(_one_all_gather_per_group_per_forward, 2)


class _SkipsHeadGPT(TinyGPT):
    """Returns the normed features (never runs the head) on odd calls."""

    calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x[..., :1].expand(*x.shape[:-1], 32) if self.calls % 2 == 0 else self.head(x)


def _skipped_member_steps(rank: int, world_size: int) -> None:
    def make() -> nn.Module:
        model = _SkipsHeadGPT()
        model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        return model

    # A member that did not run gets zero gradients (its flat parameter's
    # gradient covers it), which plain SGD treats as None.
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    run_parity(Parity(build=make, shard=_torchtitan_groups(ShardingStrategy.FULL_SHARD), steps=3, make_optimizer=sgd))
    torch.manual_seed(0)
    model = make()
    _torchtitan_groups(ShardingStrategy.FULL_SHARD)(model)
    inputs, _ = batch(0, 2)
    model.calls = 1  # the next call skips the head
    with torch.no_grad():
        model(inputs)
    assert_resharded(model)


def test_a_forward_that_skips_a_group_member_still_matches_and_reshards() -> None:
    run_distributed(_skipped_member_steps, 2)


def _state_dicts_round_trip(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = TinyGPT()
    torch.manual_seed(0)
    model = TinyGPT()
    _tied_group(ShardingStrategy.FULL_SHARD)(model)
    described = cs.describe(model)
    assert [u.name for u in described.units] == ["", "tok_emb+norm+head", "blocks.0", "blocks.1", "blocks.2"], [u.name for u in described.units]
    assert not [w for w in described.warnings if "is used by units" in w], described.warnings
    full = model.state_dict()
    expected = reference.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, atol=0, rtol=0, msg=key)
    options = cs.StateDictOptions(full_state_dict=True)
    torch.testing.assert_close(cs.get_model_state_dict(model, options=options)["head.weight"], reference.head.weight)
    # Optimizer state of a group's parameters, by their names, after a step.
    inputs, targets = batch(0)
    local = slice(rank * 4, rank * 4 + 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    lm_loss(model(inputs[local]), targets[local]).backward()
    lm_loss(reference(inputs), targets).backward()
    optimizer.step()
    reference_optimizer.step()
    optim_state = cs.get_optimizer_state_dict(model, optimizer, options=options)["state"]
    reference_params = dict(reference.named_parameters())
    for name in ("tok_emb.weight", "norm.weight", "norm.bias"):
        expected_avg = reference_optimizer.state[reference_params[name]]["exp_avg"]
        torch.testing.assert_close(optim_state[name]["exp_avg"], expected_avg, atol=2e-6, rtol=1e-5, msg=name)
    expected = reference.state_dict()
    changed = {key: value + 1 for key, value in expected.items()}
    model.load_state_dict(changed)
    with cs.unshard_params(model):
        torch.testing.assert_close(model.head.weight, changed["head.weight"])
        assert model.head.weight is model.tok_emb.weight
        torch.testing.assert_close(model.norm.bias, changed["norm.bias"])


def test_a_group_gives_and_takes_full_state_dicts() -> None:
    run_distributed(_state_dicts_round_trip, 2)


# ------------------------------------------------- what a group manages
def _group_manages_its_modules_and_states(rank: int, world_size: int) -> None:
    """FSDP2's managed_modules / managed_states / get_param_module_infos
    for a list of MLPs, and its lazy-init multi-module root, as ours."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    members = [model[0], model[1]]
    group_numel = sum(p.numel() for m in members for p in m.parameters())
    returned = fully_shard(members)
    assert returned is members
    assert all(is_fully_sharded(m) for m in members) and not is_fully_sharded(model[2])
    state = get_state(model[0])
    assert state is get_state(model[1]) and state.members == (model[0], model[1])
    # Managed states: exactly the members' parameters, in module order, once.
    owned = [param for handle in state.handles for param in handle.orig_params]
    expected = [p for m in members for p in m.parameters()]
    assert [id(p) for p in owned] == [id(p) for p in expected]
    # Param-module infos: each parameter's (module, attribute) owner.
    owners = [(owner.module, owner.attr) for handle in state.handles for info in handle.layout.params for owner in info.owners]
    assert owners == [(sub, attr) for m in members for sub in m.modules() for attr, _ in sub.named_parameters(recurse=False)]
    # A group cannot be the root of its tree (FSDP2: "requires a single root").
    with pytest.raises(ValueError, match="a group cannot be the root"):
        model(torch.randn(2, 8))
    planned = cs.plan(model, world_size=world_size)  # the group already made, the root planned
    assert [(unit.name, unit.numel) for unit in planned.units] == [("", 552), ("0+1", group_numel)], planned.units
    fully_shard(model)
    cs_plan = cs.describe(model)
    assert [unit.name for unit in cs_plan.units] == ["", "0+1"], [u.name for u in cs_plan.units]
    assert "0+1" in str(cs_plan)
    assert cs_plan.units[1].numel == group_numel and cs_plan.units[1].module_type == "MLP+MLP"
    assert not cs_plan.warnings, cs_plan.warnings
    torch.manual_seed(0)
    reference = nn.Sequential(*[MLP(8) for _ in range(3)])
    x = torch.randn(4, 8)
    model(x).sum().backward()
    reference(x).sum().backward()
    with cs.unshard_params(model, with_grads=True):
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, msg=name)


def test_a_group_manages_its_modules_parameters_and_is_described_as_one_unit() -> None:
    run_distributed(_group_manages_its_modules_and_states, 2)


# ------------------------------------------------------------------ errors
def _bad_groups_are_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _untied_gpt()
    with pytest.raises(ValueError, match="list of modules is empty"):
        fully_shard([])
    with pytest.raises(ValueError, match="appears twice"):
        fully_shard([model.norm, model.norm])
    with pytest.raises(ValueError, match=r"inside module 0 \(Block\)"):
        fully_shard([model.blocks[0], model.blocks[0].norm])
    with pytest.raises(TypeError, match="expected nn.Modules"):
        fully_shard([model.norm, "head"])
    assert not any(is_fully_sharded(m) for m in model.modules())
    fully_shard(model.blocks[0])
    with pytest.raises(ValueError, match=r"module 1 \(Block\) is already sharded"):
        fully_shard([model.blocks[1], model.blocks[0]])
    assert not is_fully_sharded(model.blocks[1])
    fully_shard([model.norm, model.head])
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model.head)
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard([model.blocks[1], model.norm])
    # A tree holding only part of a group (modules of different trees).
    holder = nn.Module()
    holder.head = model.head
    with pytest.raises(ValueError, match=r"outside Module's tree"):
        fully_shard(holder)
    assert not is_fully_sharded(holder)
    fully_shard(model)  # the refused calls left the model usable
    inputs, targets = batch(0, 2)
    lm_loss(model(inputs), targets).backward()
    assert_resharded(model)

    # A weight tied between a group and a module outside it cannot be split.
    torch.manual_seed(0)
    tied = TinyGPT()
    fully_shard([tied.norm, tied.head])
    with pytest.raises(ValueError, match="split between two units"):
        fully_shard(tied)
    # Buffers cast by mixed precision inside a group, the same name in two of
    # its modules: state dicts give each back in its own original dtype
    # (refused before: the dtypes were kept by name relative to one module).
    torch.manual_seed(0)
    buffered = _untied_gpt()
    buffered.norm.register_buffer("scale", torch.full((4,), 1.5))
    buffered.head.register_buffer("scale", torch.full((4,), 2.5, dtype=torch.float64))
    fully_shard([buffered.norm, buffered.head], mixed_precision=cs.MixedPrecision(buffer_dtype=torch.float16))
    fully_shard(buffered)
    assert buffered.norm.scale.dtype == buffered.head.scale.dtype == torch.float16
    for state_dict in (buffered.state_dict(), cs.get_model_state_dict(buffered)):
        assert state_dict["norm.scale"].dtype == torch.float32, state_dict["norm.scale"]
        assert state_dict["head.scale"].dtype == torch.float64, state_dict["head.scale"]
        assert torch.equal(state_dict["head.scale"], torch.full((4,), 2.5, dtype=torch.float64))
    inputs, targets = batch(0, 2)
    lm_loss(buffered(inputs), targets).backward()
    assert_resharded(buffered)


def test_bad_groups_raise_at_once_and_leave_the_model_usable() -> None:
    run_distributed(_bad_groups_are_refused, 2)
