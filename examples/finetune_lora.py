"""LoRA fine-tuning of a Hugging Face Llama-style model with ``peft``, sharded
with ``composable_shard.fully_shard``.

Owns: the fine-tuning recipe: model (from a config or a local checkpoint),
LoRA adapters, activation checkpointing, sharding, an optimizer over the
adapters only, the training loop, and saving the adapters so that ``peft``
loads them.
Knows nothing of: how ``fully_shard`` works inside.

Run::

    torchrun --nproc_per_node 2 examples/finetune_lora.py                     # CPU: a small Llama from a config
    torchrun --nproc_per_node 2 examples/finetune_lora.py --model PATH        # a local checkpoint directory
    torchrun --nproc_per_node 8 examples/finetune_lora.py --model PATH --device cuda

Then, in one process::

    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained("runs/lora/base")   # or PATH
    model = PeftModel.from_pretrained(base, "runs/lora/adapter")

What it shows:
- ``get_peft_model`` first, then HF's own activation checkpointing
  (``gradient_checkpointing_enable``), then ``fully_shard`` on every decoder
  layer and on the root. Each layer's unit holds two flat parameters, one
  frozen (the base weights: sharded, never given a gradient, never reduced)
  and one trainable (the adapters);
- the optimizer takes only the parameters that require grad (the adapters);
  its state is sharded like them;
- the table of what each rank holds (``composable_shard.describe``);
- the adapters are gathered to rank 0's CPU with ``get_model_state_dict``
  (``full_state_dict``, ``ignore_frozen_params``: the frozen base is never
  gathered) and written with peft's ``save_pretrained``.

Data: the Python standard library's source (``data.py``), as bytes (a
vocabulary of 256 for the model built from a config) or, with ``--model``,
through the checkpoint's tokenizer when it has one.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # composable_shard from a checkout

from composable_shard import StateDictOptions, describe, fully_shard, get_model_state_dict  # noqa: E402
from data import VOCAB_SIZE, ByteCorpus, rank_slice, stdlib_bytes  # noqa: E402
from train_gpt import init_distributed, memory_report  # noqa: E402

logger = logging.getLogger("finetune_lora")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="local checkpoint directory (default: a small Llama from a config)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=Path("runs/lora"), help="adapter/ (and base/ for a config model) go here")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, split over ranks")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    # The model built from a config when --model is not given.
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--data-bytes", type=int, default=1_000_000, help="bytes of stdlib source to train on")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


# -- data ------------------------------------------------------------------------


def load_corpus(args: argparse.Namespace, vocab_size: int) -> ByteCorpus:
    """Bytes, or the checkpoint's tokenizer over the same text."""
    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as error:  # a checkpoint without tokenizer files
            logger.info("no tokenizer in %s (%s): using bytes", args.model, type(error).__name__)
    if tokenizer is None:
        if vocab_size < VOCAB_SIZE:
            raise ValueError(f"--model {args.model}: vocabulary {vocab_size} < 256 and no tokenizer; byte tokens do not fit.")
        return ByteCorpus.from_stdlib(args.data_bytes)
    text = stdlib_bytes(args.data_bytes).decode("utf-8", errors="replace")
    tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    n_train = int(len(tokens) * 0.9)
    return ByteCorpus(train=tokens[:n_train], val=tokens[n_train:])


# -- model -----------------------------------------------------------------------


def build_base(args: argparse.Namespace) -> nn.Module:
    """The frozen base model, identical on every rank."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model is not None:
        import transformers

        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
        return AutoModelForCausalLM.from_pretrained(args.model, **{dtype_key: torch.float32})
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.block_size,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)  # same weights on every rank
    return LlamaForCausalLM(config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.get_base_model()
    return inner.model.layers  # LlamaForCausalLM and most decoder-only HF models


def build_model(args: argparse.Namespace, device: torch.device, base_dir: Path | None) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = build_base(args).to(device)
    if base_dir is not None and dist.get_rank() == 0:
        base.save_pretrained(base_dir)  # a config model's random weights: the adapters only make sense with them
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(base, lora)  # freezes the base, adds trainable lora_A / lora_B
    if base_dir is not None:  # where PeftModel.from_pretrained users find the base
        model.peft_config["default"].base_model_name_or_path = str(base_dir)
    if not args.no_activation_checkpointing:
        # HF's own: each decoder layer's forward is recomputed in backward
        # (transformers 5 renamed gradient_checkpointing_enable).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)  # the root: embeddings, final norm, lm_head (all frozen)
    model.train()
    return model


# -- steps -----------------------------------------------------------------------


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def global_mean(value: torch.Tensor) -> float:
    """Mean over ranks of equal slices' losses = the global batch's loss."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()  # a host-device sync point


@torch.no_grad()
def val_loss(model: nn.Module, corpus: ByteCorpus, args: argparse.Namespace, device: torch.device) -> float:
    """Loss on one fixed global batch of the validation split."""
    model.eval()
    x, y = corpus.get_batch("val", args.batch_size, args.block_size, torch.Generator().manual_seed(args.seed))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loss = lm_loss(model, rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device))
    model.train()
    return global_mean(loss)


def save_adapters(model: nn.Module, adapter_dir: Path) -> None:
    """Gather the trainable (adapter) parameters to rank 0's CPU and write them
    with peft's ``save_pretrained``. A collective: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)  # {} on ranks other than 0
    if dist.get_rank() == 0:
        model.save_pretrained(adapter_dir, state_dict=state)  # keeps the lora_ keys, in peft's format
    dist.barrier()


def log_what_each_rank_holds(model: nn.Module, rank: int, world_size: int) -> None:
    """Rank 0's table from ``describe``, then one line per rank."""
    plan = describe(model, optimizer="adamw")  # this rank's layouts, as fully_shard built them
    if rank == 0:
        logger.info("what each rank holds:\n%s", plan)
    flat_params = [fp for unit in plan.units for fp in unit.flat_params]
    mine = {
        "trainable": sum(fp.shard_bytes for fp in flat_params if fp.requires_grad),
        "frozen": sum(fp.shard_bytes for fp in flat_params if not fp.requires_grad),
        "grads": plan.rank_bytes["grads"],
        "optimizer": plan.rank_bytes["optimizer"],
    }
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    for r, held in enumerate(every):
        logger.info(
            "rank %d: parameters trainable %.1f KiB, frozen %.1f KiB | gradients %.1f KiB | AdamW state %.1f KiB",
            r, held["trainable"] / 2**10, held["frozen"] / 2**10, held["grads"] / 2**10, held["optimizer"] / 2**10,
        )  # fmt: skip


# -- training --------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    rank, world_size, device = init_distributed(args.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"%(asctime)s [rank{rank}] %(message)s")
    logger.info("world size %d on %s (%s)", world_size, device, dist.get_backend())
    base_dir = args.out / "base" if args.model is None else None
    model = build_model(args, device, base_dir)
    corpus = load_corpus(args, model.get_base_model().config.vocab_size)
    logger.info(
        "LoRA r=%d on %s; fully_shard on %d decoder layers and the root; activation checkpointing %s",
        args.lora_r, ",".join(LORA_TARGETS), len(decoder_layers(model)),
        "off" if args.no_activation_checkpointing else "on",
    )  # fmt: skip
    log_what_each_rank_holds(model, rank, world_size)

    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=args.lr, weight_decay=0.0)
    logger.info("val loss before %.4f", val_loss(model, corpus, args, device))

    tokens_per_step = args.batch_size * args.block_size  # global
    t_last, step_last = time.perf_counter(), 0
    for step in range(args.steps):
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, torch.Generator().manual_seed(args.seed + step))
        loss = lm_loss(model, rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device))
        loss.backward()  # the adapters' gradients are reduced; the frozen base gets none
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.perf_counter() - t_last
            logger.info(
                "step %4d/%d | loss %.4f | %.0f tok/s | %s",
                done, args.steps, global_mean(loss), tokens_per_step * (done - step_last) / elapsed, memory_report(device),
            )  # fmt: skip
            t_last, step_last = time.perf_counter(), done

    logger.info("val loss after %.8f", val_loss(model, corpus, args, device))
    save_adapters(model, args.out / "adapter")
    logger.info("saved adapters to %s%s", args.out / "adapter", f" (base model in {base_dir})" if base_dir else "")


def main() -> None:
    train(parse_args())
    # The model is gone with train's frame, but its units are reference cycles
    # that hold the process group: collect them first, so that
    # destroy_process_group really ends it (gloo's and the store's threads;
    # a process that exits with them still running can abort at exit).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
