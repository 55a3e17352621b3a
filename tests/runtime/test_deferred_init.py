"""Deferred initialisation: a model built on the meta device is materialised
unit by unit (``param_init_fn`` or ``reset_parameters``) with the same values
as the documented per-module order gives eagerly, ``sync_module_states``
makes every rank start from rank 0's parameters and buffers, ``device_id``
moves a CPU-built model, and the peak memory of deferred initialisation is
the shards plus about one unit, not the whole model."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from composable_shard import ShardingStrategy, fully_shard, is_fully_sharded, unshard_params
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import requires_cuda, run_distributed
from tests.support.models import Block, TinyGPT, batch
from tests.support.parity import Parity, compare_full, plain_step, run_parity


def _init_gpt(module: nn.Module) -> None:
    """param_init_fn for TinyGPT: its root owns pos_emb and has no
    reset_parameters; every other module resets itself."""
    if isinstance(module, TinyGPT):
        nn.init.normal_(module.pos_emb, std=0.02)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def _preorder(module: nn.Module, stop: type[nn.Module] | None, is_unit_root: bool = True) -> list[nn.Module]:
    """``module`` and its descendants in pre-order, not entering ``stop``
    instances below it (nested units)."""
    if stop is not None and isinstance(module, stop) and not is_unit_root:
        return []
    found = [module]
    for child in module.children():
        found += _preorder(child, stop, is_unit_root=False)
    return found


def _eager_reference(seed: int) -> TinyGPT:
    """TinyGPT initialised eagerly, module by module, in the order
    ``fully_shard(model, policy={Block})`` documents (see [Note: deferred
    initialisation] in composable_shard/init.py): units children first, each
    unit's modules in pre-order without entering nested units; a module whose
    tensors are all initialised already (the head, tied to the embedding) is
    not initialised again. RNG order differs from plain ``TinyGPT()``, so
    that is not the reference."""
    model = TinyGPT()
    order = [m for block in model.blocks for m in _preorder(block, None)] + _preorder(model, Block)
    seen: set[int] = set()
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in order:
            own = {id(t) for t in [*module._parameters.values(), *module._buffers.values()] if t is not None}
            if own and not own <= seen:
                _init_gpt(module)
            seen |= own
    return model


def _meta_init_matches_eager_init(rank: int, world_size: int) -> None:
    for build_on_meta in (True, False):
        if build_on_meta:
            with torch.device("meta"):
                model = TinyGPT()
            assert all(p.is_meta for p in model.parameters())
        else:  # eagerly on CPU: fully_shard must not re-initialise it
            model = _eager_reference(1)
        params_before = {name: p for name, p in model.named_parameters()}
        torch.manual_seed(1)
        fully_shard(model, policy={Block}, param_init_fn=_init_gpt)
        assert all(is_fully_sharded(block) for block in model.blocks)
        # Same nn.Parameter objects; tied weights stay tied.
        assert {name: p for name, p in model.named_parameters()} == params_before
        assert model.head.weight is model.tok_emb.weight
        assert not any(p.is_meta for p in model.parameters())
        reference = _eager_reference(1)
        with unshard_params(model, writeback=False):
            for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(param, expected), f"{name} differs from the eager reference"
        # And it trains like the reference.
        parity = Parity(build=TinyGPT, shard=lambda m: None, atol=2e-6, rtol=1e-5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(2):
            inputs, targets = batch(step)
            plain_step(reference, inputs, targets)
            local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
            plain_step(model, inputs[local], targets[local])
            compare_full(model, reference, parity, f"meta={build_on_meta} step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_model_materialises_like_eager_init_in_the_documented_order(world_size: int) -> None:
    run_distributed(_meta_init_matches_eager_init, world_size)


class _BlockWithBuffer(Block):
    """A block with a random buffer, so sync_module_states must sync buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(16))
        self.reset_scale()

    def reset_scale(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _record_init(record: dict[str, torch.Tensor], names: dict[int, str]):
    def init(module: nn.Module) -> None:
        if isinstance(module, _BlockWithBuffer):
            module.reset_scale()
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                record[f"{names[id(module)]}{attr}"] = tensor.detach().clone()

    return init


def _sync_module_states_gives_rank0_values(rank: int, world_size: int, hybrid: bool = False) -> None:
    # HYBRID: rank 0's values reach the shard group, then the replicate group.
    mesh_kwargs = (
        dict(device_mesh=init_device_mesh("cpu", (2, world_size // 2)), strategy=ShardingStrategy.HYBRID_SHARD)
        if hybrid
        else {}
    )
    for build_on_meta in (True, False):
        torch.manual_seed(100 + rank)  # every rank draws different values
        with torch.device("meta" if build_on_meta else "cpu"):
            model = nn.Sequential(_BlockWithBuffer(), _BlockWithBuffer())
        names = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
        record: dict[str, torch.Tensor] = {}
        if not build_on_meta:
            record = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        fully_shard(
            model,
            policy={_BlockWithBuffer},
            sync_module_states=True,
            param_init_fn=_record_init(record, names),
            **mesh_kwargs,  # type: ignore[arg-type]
        )
        gathered: list[dict[str, torch.Tensor] | None] = [None] * world_size
        dist.all_gather_object(gathered, record)
        rank0 = gathered[0]
        assert rank0 is not None and set(rank0) == {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
        assert any(not torch.equal(gathered[1][n], rank0[n]) for n in rank0), "ranks drew the same values"  # type: ignore[index]
        for name, buffer in model.named_buffers():
            assert torch.equal(buffer, rank0[name]), f"buffer {name} is not rank 0's"
        with unshard_params(model, writeback=False):
            for name, param in model.named_parameters():
                assert torch.equal(param, rank0[name]), f"{name} is not rank 0's (meta={build_on_meta})"


@pytest.mark.parametrize("world_size, hybrid", [(2, False), (4, False), (4, True)])
def test_sync_module_states_starts_every_rank_from_rank0(world_size: int, hybrid: bool) -> None:
    run_distributed(_sync_module_states_gives_rank0_values, world_size, hybrid)


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))


def _errors_leave_model_untouched(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _NoReset())
    with pytest.raises(ValueError, match=r"'1' \(_NoReset\) was built on the meta device.*param_init_fn"):
        fully_shard(model, policy={nn.Linear})
    assert not any(is_fully_sharded(m) for m in model.modules())
    assert all(p.is_meta for p in model.parameters())

    def replace_params(module: nn.Module) -> None:  # an FSDP1-style init: to_empty replaces parameters
        module.to_empty(device="cpu", recurse=False)
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        else:
            nn.init.ones_(module.weight)

    params_before = list(model.parameters())
    fully_shard(model, policy={nn.Linear}, param_init_fn=replace_params)
    assert list(model.parameters()) == params_before  # identity restored
    with unshard_params(model, writeback=False):
        assert torch.equal(model[1].weight, torch.ones(4, 4))


def test_meta_module_without_initialiser_raises_before_sharding_and_fsdp1_style_init_fn_works() -> None:
    run_distributed(_errors_leave_model_untouched, 2)


def _unwritten_tensors_refused(rank: int, world_size: int) -> None:
    def only_on_meta(module: nn.Module) -> None:  # FSDP1's test_fsdp_meta init: nothing is on meta here
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()

    def weights_only(module: nn.Module) -> None:
        nn.init.ones_(module.weight)

    def all_but_a_row(module: nn.Module) -> None:
        module.reset_parameters()
        module.weight[0].fill_(float("nan"))  # unwritten, as an init that skipped it leaves it

    cases = [(only_on_meta, r"\['weight', 'bias'\]"), (weights_only, r"\['bias'\]"), (all_but_a_row, r"\['weight'\]")]
    for init, unwritten in cases:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with pytest.raises(ValueError, match=rf"module '0' \(Linear\) was built on the meta device, and param_init_fn\(module\) left {unwritten} \(partly\) unwritten.*FSDP1"):
            fully_shard(model, policy={nn.Linear}, param_init_fn=init)
    # Writing every tensor passes, and the values are the init's.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, policy={nn.Linear}, param_init_fn=lambda module: [nn.init.ones_(p) for p in module.parameters(recurse=False)])
    with unshard_params(model, writeback=False):
        assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


def test_an_init_that_leaves_a_tensor_unwritten_is_refused_by_name() -> None:
    run_distributed(_unwritten_tensors_refused, 2)


def _device_id_on_cpu_is_a_no_op(rank: int, world_size: int) -> None:
    run_parity(Parity(build=TinyGPT, shard=lambda m: fully_shard(m, policy={Block}, device_id=torch.device("cpu"))))


def test_device_id_cpu_trains_like_reference() -> None:
    run_distributed(_device_id_on_cpu_is_a_no_op, 2)


# ------------------------------------------------------------ peak memory
_SLAB_IN, _SLAB_OUT, _N_SLABS = 1024, 1024, 16  # 16 units of ~4 MiB: 64 MiB of fp32


class _Slabs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slabs = nn.ModuleList(nn.Linear(_SLAB_IN, _SLAB_OUT) for _ in range(_N_SLABS))


def _peak_allocated_bytes(fn) -> tuple[int, int]:
    """(peak, end) bytes of CPU tensor memory live during ``fn()`` beyond
    what was live before it, from the profiler's allocator events (every
    allocation and free of the CPU allocator, temporaries included)."""
    from torch.profiler import ProfilerActivity, profile

    # A collection inside the window would free earlier tests' (or the
    # previous build's) objects whose allocations the allocator's profiler
    # table still knows, and lower the peak: seen after
    # tests/tensor_parallel/test_tp_checkpoint.py in the same workers.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        gc.enable()
    events = []

    def walk(nodes) -> None:
        for node in nodes:
            size = getattr(node.extra_fields, "alloc_size", None)
            if size is not None and getattr(node.extra_fields, "device_type", torch.device("cpu").type) in (
                torch.device("cpu").type,
                torch._C._autograd.DeviceType.CPU,
            ):
                events.append((node.start_time_ns, size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not events:
        raise AssertionError("the profiler recorded no allocations; cannot measure peak memory")
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, live


def _deferred_init_peak_memory(rank: int, world_size: int) -> dict[str, int]:
    unit_bytes = (_SLAB_IN * _SLAB_OUT + _SLAB_OUT) * 4
    full_bytes = _N_SLABS * unit_bytes
    result: dict[str, int] = {"full_model": full_bytes, "largest_unit": unit_bytes}
    for build_on_meta in (True, False):
        holder: list[nn.Module] = []

        def build_and_shard() -> None:
            with torch.device("meta" if build_on_meta else "cpu"):
                model = _Slabs()
            fully_shard(model, policy={nn.Linear})
            holder.append(model)

        torch.manual_seed(0)
        peak, end = _peak_allocated_bytes(build_and_shard)
        sharded = sum(h.sharded_flat_param.nbytes for _, s in unit_states_under(holder[0]) for h in s.handles)
        result["meta_peak" if build_on_meta else "eager_peak"] = peak
        result["sharded"] = sharded
        result["end"] = end
        # What stays is this rank's shards (plus small padding).
        assert end <= sharded + 64 * 1024, (end, sharded)
    # Deferred: the shards plus about one unit. While unit k is built the
    # rank holds the k-1 shards before it, the unit's unsharded tensors (1
    # unit), its new shard (1/world_size unit) and, for an instant, the
    # unsharded flat buffer, allocated and at once resized to 0 (1 unit,
    # never written): about sharded + 2.5 units at the last unit. The bound
    # leaves half a unit more; the full model is far above it.
    bound = result["sharded"] + 3 * unit_bytes
    assert result["meta_peak"] <= bound, f"deferred init peaked at {result['meta_peak']} B > {bound} B: {result}"
    assert result["meta_peak"] <= 0.75 * full_bytes, result
    # The eager build holds the whole model before sharding (the contrast).
    assert result["eager_peak"] >= full_bytes, result
    return result


@pytest.mark.parametrize("world_size", [2, 4])
def test_deferred_init_peak_memory_is_shards_plus_one_unit(world_size: int) -> None:
    results = run_distributed(_deferred_init_peak_memory, world_size)
    mib = 1 << 20
    for rank, result in enumerate(results):
        print(f"world_size={world_size} rank={rank}: " + ", ".join(f"{k}={v / mib:.1f} MiB" for k, v in result.items()))


# ------------------------------------------------------------------ CUDA
def _device_id_moves_cpu_model_to_gpu(rank: int, world_size: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block}, device_id=device)
    assert all(p.device == device for p in model.parameters())
    with torch.device("meta"):
        meta_model = TinyGPT()
    fully_shard(meta_model, policy={Block}, device_id=device, param_init_fn=_init_gpt)
    assert all(p.device == device for p in meta_model.parameters())


@requires_cuda
def test_device_id_moves_a_cpu_model_to_the_gpu() -> None:
    run_distributed(_device_id_moves_cpu_model_to_gpu, 1, backend="nccl")


# ------------------------------------------------- the current CUDA device
# See [Note: the current CUDA device] in composable_shard/entry.py. No
# GPU is needed: both errors are raised before any CUDA call other than the
# two queries patched here (the availability and the current device).
_CUDA_DEVICE_ERRORS = [
    (False, 0, 0, r"compute device would be cuda:0 \(device_id=0\).*CUDA is not available.*device_id=None"),
    (
        True,
        0,
        torch.device("cuda", 1),
        r"compute device is cuda:1 \(device_id=device\(type='cuda', index=1\)\) but the current CUDA device "
        r"is cuda:0.*torch.cuda.set_device\(1\) before fully_shard",
    ),
]


def _cuda_device_errors_leave_the_model_usable(rank: int, world_size: int) -> None:
    saved = torch.cuda.is_available, torch.cuda.current_device
    for available, current, device_id, message in _CUDA_DEVICE_ERRORS:
        torch.manual_seed(0)
        model = TinyGPT()
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        try:
            torch.cuda.is_available = lambda: available  # type: ignore[assignment]
            torch.cuda.current_device = lambda: current  # type: ignore[assignment]
            with pytest.raises(ValueError, match=message):
                fully_shard(model, policy={Block}, device_id=device_id)
        finally:
            torch.cuda.is_available, torch.cuda.current_device = saved
        assert not any(is_fully_sharded(m) for m in model.modules())
        for name, param in model.named_parameters():
            assert param.device.type == "cpu" and torch.equal(param, before[name]), name
        # Still usable: sharded on CPU, it trains a step.
        fully_shard(model, policy={Block})
        model(batch(0)[0]).float().sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_cuda_device_id_without_cuda_or_not_current_is_a_clear_error() -> None:
    run_distributed(_cuda_device_errors_leave_the_model_usable, 1)


def _make_cuda_only_backend(store: object, rank: int, size: int, timeout: object) -> object:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _cpu_module_under_a_cuda_only_group_is_a_clear_error(rank: int, world_size: int) -> None:
    # A real process group whose backend declares CUDA only, as NCCL does
    # (gloo under a name registered for CUDA devices): no GPU needed.
    if "cuda_only_gloo" not in dist.Backend.backend_list:
        dist.Backend.register_backend("cuda_only_gloo", _make_cuda_only_backend, devices=["cuda"])
    group = dist.new_group(backend="cuda_only_gloo")
    torch.manual_seed(0)
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"compute device is cpu but the process group's backend \(cuda_only_gloo\) "
                       r"has no CPU support.*device_id=torch.cuda.current_device\(\)"):
        fully_shard(model, policy={Block}, process_group=group, sync_module_states=True)
    assert not any(is_fully_sharded(m) for m in model.modules())
    fully_shard(model, policy={Block})  # a gloo group: fine
    model(batch(0)[0]).float().sum().backward()
    dist.destroy_process_group(group)


def test_cpu_module_under_a_group_without_cpu_backend_is_a_clear_error() -> None:
    run_distributed(_cpu_module_under_a_cuda_only_group_is_a_clear_error, 2)
