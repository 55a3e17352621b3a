"""Parity of fully_shard on Hugging Face models built from tiny configs (no
download): a Llama (a unit per decoder layer, and its layers grouped by
``SmallUnitGroups``), a GPT-2 whose head is tied to its embedding (and its full
state dict loading strictly into a fresh GPT2LMHeadModel), a peft LoRA Llama
training only its adapters, HF's own gradient checkpointing, and HF's
``generate`` on the sharded model through ``register_forward_method``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from composable_shard import SmallUnitGroups, StateDictOptions, fully_shard, get_model_state_dict
from composable_shard.runtime.state import get_state

from tests.support.harness_pool import run_distributed
from tests.support.hf_models import decoder_layers, hf_step, tiny_gpt2, tiny_llama, tiny_lora_llama
from tests.support.models import batch
from tests.support.parity import Parity, adamw, run_parity


def _shard_layers_and_root(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def _grouped_layers_and_root(model: nn.Module) -> None:
    """The decoder layers in groups of small units ([Note: groups of small units])."""
    layers = decoder_layers(model)
    fully_shard(model, policy=SmallUnitGroups({type(layers[0])}))
    assert get_state(layers[0]) is get_state(layers[-1]) is not get_state(model)


def _check_compared(parity: Parity, model: nn.Module) -> None:
    """Every trainable parameter's gradient was compared at every step."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    missing = trainable - set(parity.compared)
    if missing:
        raise AssertionError(f"gradients never compared: {sorted(missing)}")


def _llama_matches_reference(rank: int, world_size: int) -> None:
    for shard in (_shard_layers_and_root, _grouped_layers_and_root):
        parity = Parity(build=tiny_llama, shard=shard, step_fn=hf_step, reference_step_fn=hf_step)
        run_parity(parity)
        _check_compared(parity, tiny_llama())


@pytest.mark.parametrize("world_size", [2])  # 4 ranks: 4 transformers imports on 2 cores, no new path
def test_hf_llama_matches_reference(world_size: int) -> None:
    run_distributed(_llama_matches_reference, world_size)


def _gpt2_case(rank: int, world_size: int) -> None:
    from transformers import GPT2LMHeadModel

    models: list[nn.Module] = []

    def build() -> nn.Module:
        models.append(tiny_gpt2())
        return models[-1]

    # SGD, not AdamW: the key part of c_attn.bias has an exactly zero true
    # gradient (softmax ignores a shift shared by all keys), so its computed
    # gradient is round-off, which Adam's normalisation would blow up to
    # lr-sized, order-dependent updates in any two differently batched runs.
    parity = Parity(
        build=build,
        shard=_shard_layers_and_root,
        step_fn=hf_step,
        reference_step_fn=hf_step,
        make_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    )
    run_parity(parity)
    model = models[0]
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise AssertionError("fully_shard untied GPT-2's lm_head from wte")
    _check_compared(parity, model)

    inputs, _ = batch(99)
    with torch.no_grad():
        sharded_logits = model(input_ids=inputs).logits  # a collective: every rank runs it
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        assert full == {}, sorted(full)
        return
    fresh = GPT2LMHeadModel(model.config)
    expected_keys = set(fresh.state_dict())
    assert set(full) == expected_keys, set(full) ^ expected_keys
    fresh.load_state_dict(full, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight, "loading untied the fresh model"
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=inputs).logits, sharded_logits, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("world_size", [2])
def test_hf_gpt2_tied_matches_reference_and_full_state_dict_loads_strictly(world_size: int) -> None:
    run_distributed(_gpt2_case, world_size)


def _adapters_only(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _lora_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = hf_step(model, inputs, targets)
    for name, param in model.named_parameters():
        if not param.requires_grad and param.grad is not None:
            raise AssertionError(f"frozen {name} got a gradient")
    return loss


def _peft_lora_matches_reference(rank: int, world_size: int) -> None:
    parity = Parity(
        build=tiny_lora_llama,
        shard=_shard_layers_and_root,
        step_fn=_lora_step,
        reference_step_fn=hf_step,
        make_optimizer=_adapters_only,
    )
    run_parity(parity)
    _check_compared(parity, tiny_lora_llama())
    if not parity.compared or not all("lora_" in name for name in set(parity.compared)):
        raise AssertionError(f"expected only LoRA gradients, compared {sorted(set(parity.compared))}")


@pytest.mark.parametrize("world_size", [2])
def test_peft_lora_llama_trains_adapters_only_and_matches_reference(world_size: int) -> None:
    run_distributed(_peft_lora_matches_reference, world_size)


def _with_hf_checkpointing(build, kwargs: dict | None):
    def build_checkpointed() -> nn.Module:
        model = build()
        with warnings.catch_warnings():  # transformers 5 renamed it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if not all(layer.gradient_checkpointing for layer in decoder_layers(model)):
            raise AssertionError("gradient_checkpointing_enable left a layer unchecked")
        return model

    return build_checkpointed


def _counting_recomputation(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hf_step that also checks each layer's forward ran twice (once recomputed)."""
    calls: list[str] = []
    handles = [
        # A pre-hook: non-reentrant recomputation stops early, right after the
        # last saved tensor it needs, before a forward hook on the MLP would run.
        layer.mlp.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
        for index, layer in enumerate(decoder_layers(model))
    ]
    try:
        loss = hf_step(model, inputs, targets)
    finally:
        for handle in handles:
            handle.remove()
    layers = len(decoder_layers(model))
    if sorted(calls) != sorted(list(range(layers)) * 2):
        raise AssertionError(f"expected every layer's MLP to run twice (forward + recompute), ran {calls}")
    return loss


def _hf_gradient_checkpointing_matches_reference(rank: int, world_size: int) -> None:
    cases = {
        "default (use_reentrant=False)": (tiny_llama, None),
        "use_reentrant=True": (tiny_llama, {"use_reentrant": True}),
        "peft LoRA": (tiny_lora_llama, None),
    }
    for name, (build, kwargs) in cases.items():
        optimizer = _adapters_only if build is tiny_lora_llama else adamw
        try:
            run_parity(
                Parity(
                    build=_with_hf_checkpointing(build, kwargs),
                    shard=_shard_layers_and_root,
                    step_fn=_counting_recomputation,
                    reference_step_fn=hf_step,
                    make_optimizer=optimizer,
                    steps=2,
                )
            )
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


@pytest.mark.parametrize("world_size", [2])
def test_hf_gradient_checkpointing_matches_reference(world_size: int) -> None:
    run_distributed(_hf_gradient_checkpointing_matches_reference, world_size)


def _generate_matches_reference(rank: int, world_size: int) -> list[list[int]]:
    """HF's ``generate`` (greedy, KV cache), registered with
    ``register_forward_method`` on the sharded root: it calls the model once
    per new token ([Note: forward methods] in runtime/hooks.py)."""
    from composable_shard import register_forward_method

    for build in (tiny_llama, tiny_gpt2):
        torch.manual_seed(0)
        reference = build().eval()
        model = build().eval()
        model.load_state_dict(reference.state_dict())
        _shard_layers_and_root(model)
        register_forward_method(model, "generate")
        prompt = batch(rank, 2)[0][:, :5]
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.generate(prompt, **kwargs)
        want = reference.generate(prompt, **kwargs)
        assert got.shape == (2, 11) and torch.equal(got, want), (build.__name__, got, want)
        # A training step follows as usual: every parameter gets its gradient.
        model.train()
        hf_step(model, *batch(rank, 2))
        assert all(param.grad is not None for param in model.parameters()), build.__name__
    return got.tolist()


def test_hf_generate_on_the_sharded_model_matches_the_unsharded_one() -> None:
    tokens = run_distributed(_generate_matches_reference, 2, timeout=240)
    assert tokens[0] != tokens[1]  # each rank generated from its own prompt
