"""The flat-parameter handle library on its own (no hooks): layout, shard and
unshard, views, freeing, gradient reduction and accumulation, write-back,
mixed-precision copies, over random layouts at world sizes 1, 2 and 4."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from expecttest import assert_expected_inline

from composable_shard.comm import ShardGroups
from composable_shard.handle.layout import ALIGNMENT_BYTES, ParamOwner, compute_layout
from composable_shard.handle import FlatParamHandle, FlatParamSource

from tests.support.harness_pool import run_distributed, world_sizes

_SHAPES = [(), (0,), (1,), (3,), (7,), (5, 3), (2, 3, 4), (0, 4), (1, 1, 1), (13,), (4, 4)]
_DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _random_module(seed: int) -> nn.Module:
    """Modules with random shapes (0-d, 0-numel, odd sizes, many small ones),
    mixed dtypes and requires_grad, and a parameter tied across modules."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for index in range(rng.randint(3, 6)):
        child = nn.Module()
        for name_index in range(rng.randint(1, 6)):
            shape = rng.choice(_SHAPES)
            dtype = rng.choice(_DTYPES)
            data = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
            child.register_parameter(f"p{name_index}", nn.Parameter(data, requires_grad=rng.random() < 0.7))
        root.add_module(f"child{index}", child)
    tied = nn.Parameter(torch.randn(3, 2, generator=generator))
    root.child0.register_parameter("tied", tied)
    root.get_submodule(f"child{len(root._modules) - 1}").register_parameter("tied_alias", tied)
    return root


def _sources_by_group(module: nn.Module) -> list[list[FlatParamSource]]:
    """One source list per (dtype, requires_grad), as fully_shard groups them."""
    owners: OrderedDict[int, tuple[nn.Parameter, list[ParamOwner]]] = OrderedDict()
    for module_name, submodule in module.named_modules():
        for attr, param in submodule._parameters.items():
            fqn = f"{module_name}.{attr}" if module_name else attr
            owners.setdefault(id(param), (param, []))[1].append(ParamOwner(submodule, attr, fqn))
    groups: OrderedDict[tuple[torch.dtype, bool], list[FlatParamSource]] = OrderedDict()
    for param, param_owners in owners.values():
        groups.setdefault((param.dtype, param.requires_grad), []).append(FlatParamSource(param, tuple(param_owners)))
    return list(groups.values())


def _build(module: nn.Module, groups: ShardGroups, **kwargs: object) -> list[FlatParamHandle]:
    return [FlatParamHandle(sources, groups, compute_device=torch.device("cpu"), **kwargs) for sources in _sources_by_group(module)]


def _originals(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}


def _unshard_and_show(handle: FlatParamHandle) -> None:
    pending = handle.unshard(async_op=True)
    if pending is not None and pending.work is not None:
        pending.work.wait()
    handle.use_unsharded_views()


def _round_trip_is_exact(rank: int, world_size: int) -> None:
    for seed in range(6):
        module = _random_module(seed)
        originals = _originals(module)
        params_before = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
        handles = _build(module, ShardGroups(dist.group.WORLD, None))
        # Identity kept; each parameter holds its contiguous local range.
        for name, param in module.named_parameters(remove_duplicate=False):
            assert param is params_before[name], name
        for handle in handles:
            for info, param in zip(handle.layout.params, handle.orig_params):
                expected = originals[info.fqn].reshape(-1)[info.local_start : info.local_start + info.local_numel]
                assert torch.equal(param.detach(), expected), info.fqn
                local_numel = torch.tensor([param.numel()])
                dist.all_reduce(local_numel)
                assert local_numel.item() == info.numel, (info.fqn, local_numel.item(), info.numel)
        for handle in handles:
            _unshard_and_show(handle)
        for name, value in originals.items():
            module_name, _, attr = name.rpartition(".")
            shown = module.get_submodule(module_name)._parameters[attr]
            assert shown.shape == value.shape and shown.dtype == value.dtype, name
            assert torch.equal(shown.detach(), value), f"seed {seed}: {name} differs after unshard"
        for handle in handles:
            handle.reshard()
        for name, param in module.named_parameters(remove_duplicate=False):
            assert param is params_before[name], name
            assert module.get_submodule(name.rpartition(".")[0])._parameters[name.rpartition(".")[2]] is param


@world_sizes
def test_shard_then_unshard_is_bit_exact(world_size: int) -> None:
    run_distributed(_round_trip_is_exact, world_size)


def _views_alias_flat_storage_and_reshard_frees(rank: int, world_size: int) -> None:
    for seed in range(4):
        module = _random_module(seed)
        for handle in _build(module, ShardGroups(dist.group.WORLD, None)):
            shard_storage = handle.sharded_flat_param.untyped_storage().data_ptr()
            for info, param in zip(handle.layout.params, handle.orig_params):
                if info.local_numel:
                    assert param.untyped_storage().data_ptr() == shard_storage, info.fqn
                    element = param.element_size()
                    assert (param.data_ptr() - handle.sharded_flat_param.data_ptr()) == info.shard_offset * element
            unsharded = handle.unsharded_flat_param
            _unshard_and_show(handle)
            unsharded_storage = unsharded.untyped_storage().data_ptr()
            for info in handle.layout.params:
                view = info.owners[0].module._parameters[info.owners[0].attr]
                if view.numel():
                    assert view.untyped_storage().data_ptr() == unsharded_storage, info.fqn
                    assert (view.data_ptr() - unsharded.data_ptr()) % ALIGNMENT_BYTES == 0, info.fqn
            if world_size > 1:
                assert handle.unsharded_storage_bytes() == unsharded.numel() * unsharded.element_size()
            handle.reshard()
            assert handle.unsharded_flat_param is unsharded, "reshard must keep the tensor object"
            assert handle.unsharded_storage_bytes() == 0
            if world_size > 1:
                assert unsharded.untyped_storage().nbytes() == 0, "reshard did not free the storage"


@world_sizes
def test_views_alias_flat_storage_and_reshard_frees_unsharded_storage(world_size: int) -> None:
    run_distributed(_views_alias_flat_storage_and_reshard_frees, world_size)


def _shown(handle: FlatParamHandle) -> list[torch.Tensor]:
    return [owner.module._parameters[owner.attr] for info in handle.layout.params for owner in info.owners]


def _unshard(handle: FlatParamHandle) -> None:
    pending = handle.unshard(async_op=True)
    if pending is not None and pending.work is not None:
        pending.work.wait()


def _unshard_and_show_reused(handle: FlatParamHandle) -> None:
    _unshard(handle)
    assert handle.reuse_forward_views(), handle


def _grad_through_shown_views(handle: FlatParamHandle) -> torch.Tensor:
    total = sum(view.sum() for view in _shown(handle) if view.requires_grad)
    assert isinstance(total, torch.Tensor)
    total.backward()
    grad = handle.unsharded_flat_param.grad
    assert grad is not None
    handle.unsharded_flat_param.grad = None
    return grad


def _forward_views_reused_only_while_the_same(rank: int, world_size: int) -> None:
    """[Note: forward views reused in backward] in handle/forward_views.py."""
    for seed in range(4):
        module = _random_module(seed)
        for handle in _build(module, ShardGroups(dist.group.WORLD, None)):
            assert not handle.reuse_forward_views(), "no forward showed views yet"
            _unshard_and_show(handle)
            forward = _shown(handle)
            handle.reshard()
            if handle.needs_unshard_storage:
                assert not handle.reuse_forward_views(), "resharded: nothing to show"
            # Gathered again into the same storage object: the forward's very views.
            _unshard_and_show_reused(handle)
            assert all(a is b for a, b in zip(_shown(handle), forward)) and handle.shows_unsharded_views
            if handle.requires_grad:
                # A gradient through the reused views is the one through fresh ones.
                reused_grad = _grad_through_shown_views(handle)
                handle.use_unsharded_views()
                assert torch.equal(_grad_through_shown_views(handle), reused_grad)
                handle.reshard()
                # requires_grad changed (frozen views are detached): cut anew.
                first = handle.orig_params[0]
                first.requires_grad_(not first.requires_grad)
                handle.writeback_orig_params()
                _unshard(handle)
                assert not handle.reuse_forward_views()
                handle.reshard()
                first.requires_grad_(not first.requires_grad)
                handle.writeback_orig_params()
            # Views shown under inference mode are not kept.
            _unshard(handle)
            with torch.inference_mode():
                handle.use_unsharded_views()
            assert not handle.reuse_forward_views()
            handle.use_unsharded_views()
            assert handle.reuse_forward_views()
            # Another storage object under the flat parameter: cut anew.
            flat = handle.unsharded_flat_param
            flat.data = flat.detach().clone()
            assert not handle.reuse_forward_views()
            handle.reshard()
        # A dtype change replaces the layout and the buffer: never the old views.
        module = _random_module(seed)
        handles = _build(module, ShardGroups(dist.group.WORLD, None))
        handle = next(h for h in handles if h.layout.dtype == torch.float32)
        _unshard_and_show(handle)
        handle.reshard()
        for param in handle.orig_params:
            param.data = param.data.to(torch.float64)
        handle.writeback_orig_params()
        _unshard(handle)
        assert not handle.reuse_forward_views()
        handle.use_unsharded_views()
        assert all(view.dtype == torch.float64 for view in _shown(handle))
        assert handle.reuse_forward_views()
        handle.reshard()


@world_sizes
def test_backward_reuses_the_forward_views_only_while_they_are_the_same(world_size: int) -> None:
    run_distributed(_forward_views_reused_only_while_the_same, world_size)


def _rank_grad(handle: FlatParamHandle, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    grad = torch.randn(handle.layout.padded_unsharded_numel, generator=generator, dtype=torch.float64)
    return grad.to(handle.unsharded_flat_param.dtype)


def _reduce(handle: FlatParamHandle) -> None:
    pending = handle.reduce_grad(async_op=True)
    assert pending is not None
    if pending.work is not None:
        pending.work.wait()
    handle.finish_grad_reduction(pending)


def _reduction_is_the_mean(rank: int, world_size: int, sharded: bool) -> None:
    groups = ShardGroups(dist.group.WORLD, None) if sharded else ShardGroups(None, dist.group.WORLD if world_size > 1 else None)
    for seed in range(4):
        module = _random_module(seed)
        for handle in _build(module, groups):
            if not handle.layout.requires_grad:
                assert handle.unsharded_flat_param.requires_grad is False
                continue
            _unshard_and_show(handle)
            handle.unsharded_flat_param.grad = _rank_grad(handle, rank, seed)
            _reduce(handle)
            handle.reshard()
            mean = sum(_rank_grad(handle, r, seed).double() for r in range(world_size)) / world_size
            tolerance = dict(atol=1e-2, rtol=1e-2) if handle.layout.dtype == torch.bfloat16 else {}
            for info, param in zip(handle.layout.params, handle.orig_params):
                expected = mean[info.offset : info.offset + info.numel][info.local_start : info.local_start + info.local_numel]
                if info.local_numel == 0:  # empty, not None: see [Note: empty gradients on empty ranges]
                    assert param.grad is not None and param.grad.numel() == 0 and param.grad.dtype == param.dtype
                    continue
                assert param.grad.shape == param.shape and param.grad.dtype == param.dtype
                torch.testing.assert_close(param.grad.double(), expected, **tolerance)
            # A second backward without zero_grad accumulates.
            _unshard_and_show(handle)
            handle.unsharded_flat_param.grad = _rank_grad(handle, rank, seed)
            _reduce(handle)
            for info, param in zip(handle.layout.params, handle.orig_params):
                if info.local_numel:
                    expected = 2 * mean[info.offset : info.offset + info.numel][info.local_start : info.local_start + info.local_numel]
                    torch.testing.assert_close(param.grad.double(), expected, **tolerance)
            # After zero_grad (set_to_none) nothing is accumulated.
            for param in handle.orig_params:
                param.grad = None
            handle.unsharded_flat_param.grad = _rank_grad(handle, rank, seed)
            _reduce(handle)
            handle.reshard()
            for info, param in zip(handle.layout.params, handle.orig_params):
                if info.local_numel:
                    expected = mean[info.offset : info.offset + info.numel][info.local_start : info.local_start + info.local_numel]
                    torch.testing.assert_close(param.grad.double(), expected, **tolerance)


@world_sizes
@pytest.mark.parametrize("sharded", [True, False], ids=["reduce_scatter", "no_shard_all_reduce"])
def test_gradient_reduction_is_the_mean_and_accumulates(world_size: int, sharded: bool) -> None:
    run_distributed(_reduction_is_the_mean, world_size, sharded)


def _writeback(rank: int, world_size: int) -> None:
    module = _random_module(3)
    handles = _build(module, ShardGroups(dist.group.WORLD, None))
    handle = next(h for h in handles if h.layout.dtype == torch.float32 and any(i.numel >= 4 for i in h.layout.params))
    info, param = next((i, p) for i, p in zip(handle.layout.params, handle.orig_params) if i.numel >= 4)
    # Replacing .data with a tensor of the local size reaches the shard.
    param.data = torch.full_like(param, 7.0)
    assert handle.writeback_orig_params() == (info.local_numel > 0)
    assert torch.all(handle.local_shard_view(info) == 7.0)
    assert param.untyped_storage().data_ptr() == handle.sharded_flat_param.untyped_storage().data_ptr()
    # Replacing it with a full-shaped tensor reaches the shard too.
    full = torch.arange(info.numel, dtype=param.dtype).reshape(info.shape)
    param.data = full
    handle.writeback_orig_params()
    expected = full.reshape(-1)[info.local_start : info.local_start + info.local_numel]
    assert torch.equal(handle.local_shard_view(info), expected)
    # A changed size is refused with the parameter's name; the handle is untouched.
    shard_before = handle.sharded_flat_param.clone()
    param.data = torch.zeros(info.numel + 3)
    with pytest.raises(ValueError, match=f"parameter '{info.fqn}' changed size"):
        handle.writeback_orig_params()
    assert torch.equal(handle.sharded_flat_param, shard_before)
    param.data = handle.local_shard_view(info)
    # The round trip still works afterwards.
    _unshard_and_show(handle)
    shown = info.owners[0].module._parameters[info.owners[0].attr]
    assert torch.equal(shown.detach(), full), "every rank wrote its part of the same full tensor"
    handle.reshard()


@world_sizes
def test_writeback_of_replaced_data_and_error_on_changed_size(world_size: int) -> None:
    run_distributed(_writeback, world_size)


def _mixed_precision_copies(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    module = nn.Linear(5, 3)
    original = _originals(module)
    (handle,) = _build(module, ShardGroups(dist.group.WORLD, None), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert handle.sharded_flat_param.dtype == torch.float32
    assert handle.unsharded_flat_param.dtype == torch.bfloat16
    _unshard_and_show(handle)
    assert module._parameters["weight"].dtype == torch.bfloat16
    torch.testing.assert_close(module._parameters["weight"].float(), original["weight"], atol=1e-2, rtol=1e-2)
    handle.unsharded_flat_param.grad = torch.ones(handle.layout.padded_unsharded_numel, dtype=torch.bfloat16)
    _reduce(handle)
    handle.reshard()
    for info, param in zip(handle.layout.params, handle.orig_params):
        assert param.dtype == torch.float32
        if info.local_numel:
            assert param.grad.dtype == torch.float32 and torch.all(param.grad == 1.0)


@world_sizes
def test_mixed_precision_gathers_low_precision_and_keeps_full_precision_shard(world_size: int) -> None:
    run_distributed(_mixed_precision_copies, world_size)


def test_layout_of_a_small_module_is_stable() -> None:
    owners = [(torch.Size(shape), (ParamOwner(nn.Module(), name, name),)) for name, shape in [("weight", (3, 5)), ("bias", (3,)), ("scale", ())]]
    layout = compute_layout(owners, dtype=torch.float32, requires_grad=True, shard_rank=1, shard_world_size=4)
    assert_expected_inline(
        layout.describe(),
        """\
FlatParamLayout(dtype=torch.float32, requires_grad=True, padded_unsharded_numel=24, shard_numel=6, shard_rank=1/4)
  weight: shape=(3, 5) offset=0 numel=15 local=[6:12] shard_offset=0
  bias: shape=(3,) offset=16 numel=3 local=[0:0] shard_offset=6
  scale: shape=() offset=20 numel=1 local=[0:0] shard_offset=6""",
    )


def test_shard_split_cuts_each_parameters_local_part_where_the_layout_puts_it() -> None:
    # Every rank of 1-5 over shapes with alignment padding between parameters,
    # tail padding, parameters a rank holds nothing of, and empty ones.
    shapes = [(3, 5), (3,), (), (7,), (0,), (2, 2), (1,)]
    owners = [(torch.Size(shape), (ParamOwner(nn.Module(), f"p{i}", f"p{i}"),)) for i, shape in enumerate(shapes)]
    for world_size in range(1, 6):
        for rank in range(world_size):
            layout = compute_layout(owners, dtype=torch.float32, requires_grad=True, shard_rank=rank, shard_world_size=world_size)
            sizes, segments = layout.shard_split
            assert sum(sizes) == layout.shard_numel and all(size > 0 for size in sizes)
            shard = torch.arange(layout.shard_numel, dtype=torch.float32)
            parts = shard.split(sizes)
            for info, segment in zip(layout.params, segments):
                if info.local_numel == 0:
                    assert segment is None
                else:
                    expected = shard[info.shard_offset : info.shard_offset + info.local_numel]
                    assert torch.equal(parts[segment], expected), (world_size, rank, info.fqn)
                    assert parts[segment].data_ptr() == expected.data_ptr()


def test_low_precision_grads_are_shown_without_parameter_sized_allocations() -> None:
    # keep_low_precision_grads: autograd accepts only a .grad of the
    # parameter's dtype, so each is assigned as a stride-0 view of one 0-dim
    # placeholder the handle keeps, then swapped to its bf16 slice; nothing
    # of the parameter's size is allocated per parameter per step.
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    (handle,) = _build(module, ShardGroups(None, None), reduce_dtype=torch.bfloat16, keep_low_precision_grads=True)
    placeholders = []
    for step in range(2):
        flat_grad = torch.arange(handle.layout.shard_numel, dtype=torch.bfloat16) + step
        handle.use_sharded_grad_views(flat_grad)
        placeholders.append(handle._grad_placeholder)
        for info, param in zip(handle.layout.params, handle.orig_params):
            assert param.grad.dtype == torch.bfloat16 and param.grad.shape == param.shape
            assert param.grad.untyped_storage().data_ptr() == flat_grad.untyped_storage().data_ptr()
            expected = flat_grad[info.shard_offset : info.shard_offset + info.local_numel].view(param.shape)
            assert torch.equal(param.grad, expected)
    assert placeholders[0] is placeholders[1] and placeholders[0].numel() == 1
