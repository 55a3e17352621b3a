"""Owns: the Hugging Face models the recipe tests train — a Llama, a GPT-2 with
tied embeddings and a peft LoRA Llama, each from a tiny config built offline —
and the step that trains them through their own output objects.

Knows nothing of: composable_shard (tests apply fully_shard themselves) and
of the harness.

Importing this module sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``
in the process (workers import it by name), so nothing can reach the network.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from .models import VOCAB, lm_loss  # noqa: E402

__all__ = ["tiny_llama", "tiny_gpt2", "tiny_lora_llama", "decoder_layers", "hf_step", "LORA_TARGETS"]

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny_llama(n_layers: int = 2) -> nn.Module:
    """A ``LlamaForCausalLM`` small enough for a CPU test (GQA, RoPE, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config).train()


def tiny_gpt2(n_layers: int = 2) -> nn.Module:
    """A ``GPT2LMHeadModel`` whose ``lm_head.weight`` is ``transformer.wte.weight``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=n_layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,  # the defaults (50256) lie outside the tiny vocabulary
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).train()
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise AssertionError("tiny_gpt2: transformers did not tie lm_head to wte")
    return model


def tiny_lora_llama(n_layers: int = 2) -> nn.Module:
    """``tiny_llama`` under a peft LoRA adapter on attention and MLP projections.
    ``init_lora_weights=False`` draws both A and B at random, so the adapter
    changes the output from the first step (the default B = 0 would give A a
    zero gradient at step one)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(tiny_llama(n_layers), config).train()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of any model above (peft-wrapped or not)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "transformer"):
        return inner.transformer.h  # GPT-2
    return inner.model.layers  # Llama


def hf_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward through the HF model's output object, our own next-token loss
    (targets are already shifted), backward."""
    loss = lm_loss(model(input_ids=inputs).logits, targets)
    loss.backward()
    return loss.detach()
