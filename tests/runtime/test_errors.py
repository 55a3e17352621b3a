"""Bad use raises at once with a message naming the module or parameter and
what to do, and leaves the model usable (it still trains like the
reference)."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
import torch.nn as nn

from composable_shard import CustomPolicy, ModuleWrapPolicy, SizeBasedPolicy, fully_shard, is_fully_sharded, unshard_params
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import requires_cuda, run_distributed
from tests.support.models import DIM, Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full


def _shard_blocks_and_root(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _train_step_matches(model: nn.Module, reference: nn.Module, rank: int, world_size: int, step: int = 0) -> None:
    """One training step of both models, then full parameters compared."""
    inputs, targets = batch(step)
    per_rank = inputs.shape[0] // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    lm_loss(model(inputs[local]), targets[local]).backward()
    lm_loss(reference(inputs), targets).backward()
    for module in (model, reference):
        with torch.no_grad():
            for param in module.parameters():
                if param.grad is not None:
                    param -= 0.1 * param.grad
                    param.grad = None
    assert_resharded(model)
    compare_full(model, reference, Parity(build=TinyGPT, shard=_shard_blocks_and_root), "after the error", grads=False)


def _sharding_twice_raises(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    fully_shard(model.blocks[0])
    with pytest.raises(ValueError, match=r"fully_shard\(Block\): this module is already sharded"):
        fully_shard(model.blocks[0])
    fully_shard(model, policy=ModuleWrapPolicy({Block}))
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model.blocks[1])  # made a unit by the policy
    _train_step_matches(model, reference, rank, world_size)


def _shared_parameter_between_units_raises(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    fully_shard(model.tok_emb)  # the embedding is tied to the head outside it
    with pytest.raises(ValueError, match=r"parameter 'head.weight' is the same tensor as a parameter of the already sharded unit 'tok_emb'"):
        fully_shard(model)
    assert not is_fully_sharded(model)
    # Nothing of the failed call stuck: the root and blocks are untouched.
    for name, param in model.named_parameters():
        if not name.startswith(("tok_emb", "head")):
            assert param.shape == shapes[name], name


def _bad_arguments_raise(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="use_orig_params=False is not supported"):
        fully_shard(model, use_orig_params=False)
    with pytest.raises(TypeError, match="policy must be a Policy or a set of module classes"):
        fully_shard(model, policy=[Block])
    with pytest.raises(ValueError, match=r"overrides for Block name \['sync_module_states'\]"):
        fully_shard(model, policy=CustomPolicy(lambda m: {"sync_module_states": True} if isinstance(m, Block) else False))
    with pytest.raises(TypeError, match="ignored_states holds a str"):
        fully_shard(model, ignored_states=["blocks.0"])
    with pytest.raises(TypeError, match=r"fully_shard\(TinyGPT\): param_init_fn must be a callable taking a module, got int"):
        fully_shard(model, param_init_fn=42)
    assert not any(is_fully_sharded(m) for m in model.modules())
    assert all(p.shape == q.shape for p, q in zip(model.parameters(), reference.parameters()))
    _shard_blocks_and_root(model)
    with pytest.raises(ValueError, match="rank0_only=True with writeback=True is not supported"):
        with unshard_params(model, rank0_only=True):
            pass
    _train_step_matches(model, reference, rank, world_size)


def _input_on_wrong_device_raises(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard_blocks_and_root(model)
    inputs, _ = batch(0)
    with pytest.raises(ValueError, match=r"fully_shard\(<root>\): got an input on meta, but the module computes on cpu"):
        model(inputs.to("meta"))
    _train_step_matches(model, reference, rank, world_size)


def _changed_size_raises(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard_blocks_and_root(model)
    weight = model.blocks[1].fc_in.weight
    local = weight.data
    weight.data = torch.zeros(5, 5)
    with pytest.raises(ValueError, match=r"parameter 'blocks.1.fc_in.weight' changed size behind the shards: it holds shape \(5, 5\)"):
        model(batch(0)[0])
    weight.data = local  # what the message asks: put back a tensor of the right size
    _train_step_matches(model, reference, rank, world_size)


def _unshard_params_inside_forward_raises(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard_blocks_and_root(model)
    seen: list[str] = []

    def summon(module: nn.Module, args: tuple) -> None:
        with pytest.raises(RuntimeError, match=r"unshard_params: called inside forward or backward"):
            with unshard_params(model):
                pass
        seen.append("checked")

    handle = model.blocks[0].register_forward_pre_hook(summon)
    model(batch(0)[0][:2])
    handle.remove()
    assert seen == ["checked"]
    _train_step_matches(model, reference, rank, world_size)


_CASES = {
    "twice": _sharding_twice_raises,
    "shared": _shared_parameter_between_units_raises,
    "arguments": _bad_arguments_raise,
    "input_device": _input_on_wrong_device_raises,
    "changed_size": _changed_size_raises,
    "unshard_in_forward": _unshard_params_inside_forward_raises,
}


@pytest.mark.parametrize("case", list(_CASES))
def test_bad_use_raises_a_clear_error_and_model_still_trains(case: str) -> None:
    run_distributed(_CASES[case], 2)


class _Holder(nn.Module):
    """A module holding one parameter the forward never uses."""

    def __init__(self, param: nn.Parameter) -> None:
        super().__init__()
        self.w = param


def _odd_parameter(kind: str) -> nn.Parameter:
    from torch.testing._internal.two_tensor import TwoTensor

    if kind == "lazy":
        return nn.parameter.UninitializedParameter()
    dense = torch.randn(4, 4)
    return {
        "subclass": lambda: nn.Parameter(TwoTensor(dense, dense * 2)),
        "sparse": lambda: nn.Parameter(dense.to_sparse()),
        "nested": lambda: nn.Parameter(torch.nested.nested_tensor([dense[0], dense[1, :3]])),
        "quantized": lambda: nn.Parameter(torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), requires_grad=False),
    }[kind]()


_ODD_KINDS = {
    "subclass": "a tensor subclass \\(TwoTensor\\)",
    "sparse": "a sparse_coo tensor",
    "nested": "a nested tensor",
    "quantized": "a quantized tensor",
    "lazy": "an uninitialised parameter of a lazy module",
}


def _odd_parameters_are_refused(rank: int, world_size: int) -> None:
    for kind, what in _ODD_KINDS.items():
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        odd = _odd_parameter(kind)
        model.blocks[1].add_module("extra", _Holder(odd))
        with pytest.raises(ValueError, match=rf"fully_shard\(TinyGPT\): parameter 'blocks\.1\.extra\.w' is {what}, which a flat parameter cannot hold.*ignored_states=\[module\]"):
            fully_shard(model, policy=ModuleWrapPolicy({Block}))
        # Nothing was changed: no unit, the parameter is the same object.
        assert not any(is_fully_sharded(module) for module in model.modules()), kind
        assert model.blocks[1].extra.w is odd
        # Kept out with ignored_states, it is left as it is, and the rest trains like the reference.
        fully_shard(model, policy=ModuleWrapPolicy({Block}), ignored_states=[model.blocks[1].extra])
        assert model.blocks[1].extra.w is odd and type(odd) is type(_odd_parameter(kind)), kind
        del model.blocks[1].extra  # the reference has no such module to compare
        _train_step_matches(model, reference, rank, world_size)


def test_parameters_a_flat_parameter_cannot_hold_are_refused_by_name() -> None:
    run_distributed(_odd_parameters_are_refused, 2)


def _grad_dtype_is_refused(rank: int, world_size: int) -> None:
    has_grad_dtype = hasattr(torch.Tensor, "grad_dtype")  # torch 2.11 and later
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    weight = model.blocks[1].fc_in.weight
    for grad_dtype, shown in ((torch.float64, "torch.float64"), (None, r"None \(any dtype\)")):
        weight.grad_dtype = grad_dtype
        if not has_grad_dtype:
            break  # a plain attribute there, which autograd ignores: nothing to refuse
        with pytest.raises(ValueError, match=rf"fully_shard\(Block\): parameter 'fc_in\.weight' has grad_dtype {shown}, other than its dtype torch\.float32.*MixedPrecision\(param_dtype="):
            fully_shard(model.blocks[1])
        assert not any(is_fully_sharded(module) for module in model.modules())
    if has_grad_dtype:
        weight.grad_dtype = weight.dtype
    _shard_blocks_and_root(model)
    _train_step_matches(model, reference, rank, world_size, step=0)
    if has_grad_dtype:
        # Set after sharding: the next forward refuses it, naming it in the model.
        weight.grad_dtype = torch.float64
        inputs, _ = batch(1)
        with pytest.raises(ValueError, match=r"fully_shard: parameter 'blocks\.1\.fc_in\.weight' has grad_dtype torch\.float64"):
            model(inputs[:2])
        weight.grad_dtype = weight.dtype
    _train_step_matches(model, reference, rank, world_size, step=1)


def test_a_grad_dtype_other_than_the_parameters_is_refused_by_name() -> None:
    run_distributed(_grad_dtype_is_refused, 2)


def _containers_refused_and_passed_over(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"fully_shard\(ModuleList\): a ModuleList has no forward of its own.*never gather"):
        fully_shard(model.blocks)
    with pytest.raises(ValueError, match=r"fully_shard\(TinyGPT\): the policy chose 'blocks' \(ModuleList\) as a unit, but a ModuleList"):
        fully_shard(model, policy=ModuleWrapPolicy({nn.ModuleList, Block}))
    assert not any(is_fully_sharded(module) for module in model.modules())
    # A size-based policy passes over the container: each block alone is
    # below the threshold, the three together above it, so every parameter
    # goes to the root (before: the list was a unit that never gathered and
    # the first forward raised in a Linear on 1-D shards).
    block_numel = sum(param.numel() for param in model.blocks[0].parameters())
    fully_shard(model, policy=SizeBasedPolicy(2 * block_numel))
    assert [name for name, _ in unit_states_under(model)] == [""]
    _train_step_matches(model, reference, rank, world_size)


def test_containers_without_a_forward_are_refused_and_passed_over() -> None:
    run_distributed(_containers_refused_and_passed_over, 2)


class _AttentionBlock(nn.Module):
    """A residual block around ``nn.MultiheadAttention``, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.mha(x, x, x, need_weights=False)[0])


def _attention_gpt() -> nn.Module:
    model = TinyGPT(n_blocks=0)
    model.blocks = nn.ModuleList([_AttentionBlock() for _ in range(2)])
    return model


def _multihead_attention_children(rank: int, world_size: int) -> None:
    # MultiheadAttention passes out_proj's parameters to its functional form
    # and never calls out_proj: before, a policy that picked out_proj (its
    # size alone, or a Linear subclass) made a unit that never gathered, and
    # the first forward raised "mat2 must be a matrix".
    out_proj_numel = DIM * DIM + DIM
    for policy, expected in (
        (SizeBasedPolicy(out_proj_numel), ["", "tok_emb", "blocks.0.mha", "blocks.0.fc", "blocks.1.mha", "blocks.1.fc"]),
        (ModuleWrapPolicy({nn.Linear}), ["", "blocks.0.fc", "blocks.1.fc", "head"]),
    ):
        torch.manual_seed(0)
        model = _attention_gpt()
        reference = copy.deepcopy(model)
        fully_shard(model, policy=policy)
        assert [name for name, _ in unit_states_under(model)] == expected, type(policy).__name__
        _train_step_matches(model, reference, rank, world_size)
    # Made a unit by hand: refused by name once a call covers the attention.
    model = _attention_gpt()
    fully_shard(model.blocks[1].mha.out_proj)
    refused = (
        r"fully_shard\(TinyGPT\): 'blocks\.1\.mha\.out_proj' \(NonDynamicallyQuantizableLinear\) is a unit, but its "
        r"parent MultiheadAttention reads its parameters without calling it.*Make 'blocks\.1\.mha'"
    )
    with pytest.raises(ValueError, match=refused):
        fully_shard(model)
    assert not is_fully_sharded(model)


def test_children_of_multihead_attention_are_never_units() -> None:
    run_distributed(_multihead_attention_children, 2)


def _size_policy_counts_whole_parameters(rank: int, world_size: int) -> None:
    # A block's parameters besides fc_in stay below the threshold; fc_in is
    # an earlier unit (its parameters are now this rank's shard) or ignored.
    # Before, the policy counted those too, at their local size (another on
    # each rank: ranks could choose different units and hang), and made
    # blocks.0 a unit.
    threshold = sum(param.numel() for name, param in Block().named_parameters() if not name.startswith("fc_in")) + 1
    for earlier_unit in (True, False):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        if earlier_unit:
            fully_shard(model.blocks[0].fc_in)
            fully_shard(model, policy=SizeBasedPolicy(threshold))
        else:
            fully_shard(model, policy=SizeBasedPolicy(threshold), ignored_states=[model.blocks[0].fc_in])
        units = [name for name, _ in unit_states_under(model)]
        assert units == ["", *(["blocks.0.fc_in"] if earlier_unit else []), "blocks.1", "blocks.2"], units
        if earlier_unit:  # ignored parameters' gradients stay local: no parity to check there
            _train_step_matches(model, reference, rank, world_size)


def test_size_based_policy_counts_neither_earlier_units_nor_ignored_modules() -> None:
    run_distributed(_size_policy_counts_whole_parameters, 2)


def _copies_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard_blocks_and_root(model)
    _train_step_matches(model, reference, rank, world_size, step=0)
    refused = r"a sharded module cannot be deep-copied or pickled \(unit '{}', {}\).*Copy the model before fully_shard"
    with pytest.raises(TypeError, match=refused.format("<root>", "TinyGPT")):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match=refused.format(r"blocks\.0", "Block")):
        torch.save(model.blocks[0], io.BytesIO())
    _train_step_matches(model, reference, rank, world_size, step=1)


def test_deepcopy_and_pickling_of_a_sharded_module_are_refused_by_name() -> None:
    run_distributed(_copies_refused, 2)


def _params_on_different_devices_raise(rank: int, world_size: int) -> None:
    model = TinyGPT()
    model.blocks.cuda(rank)
    devices = {name: str(param.device) for name, param in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(ValueError, match=r"fully_shard\(TinyGPT\): parameters are on different devices") as info:
        fully_shard(model)
    # Whichever parameter is found first on each device is named (the order
    # is the model's, not part of the contract): one on the CPU, one on the
    # GPU, each with its own device.
    named = re.findall(r"'([\w.]+)' on (cpu|cuda:\d+)", str(info.value))
    assert len(named) == 2, str(info.value)
    assert {device.split(":")[0] for _, device in named} == {"cpu", "cuda"}, str(info.value)
    for name, device in named:
        assert devices.get(name) == device, f"{name} is on {devices.get(name)}, the message says {device}"
    assert "Move the module to one device" in str(info.value)
    assert not is_fully_sharded(model)


@requires_cuda
def test_parameters_on_different_devices_raise() -> None:
    run_distributed(_params_on_different_devices_raise, 1, backend="nccl")
