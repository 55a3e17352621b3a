"""examples/finetune_lora.py end to end, as the README runs it (torchrun, 2
processes, CPU), on a small config: the adapters it writes load with peft
into a fresh model that computes the validation loss the sharded model
printed, and they hold only the LoRA weights."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.support import hf_models  # noqa: F401  (sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE here too)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "finetune_lora.py"
SMALL = {
    "--steps": 3,
    "--hidden-size": 32,
    "--layers": 2,
    "--heads": 4,
    "--block-size": 32,
    "--batch-size": 4,
    "--lora-r": 4,
    "--lora-alpha": 8,
    "--data-bytes": 100_000,
    "--log-every": 1,
    "--seed": 5,
}


def _example_data():
    spec = importlib.util.spec_from_file_location("finetune_example_data", REPO_ROOT / "examples" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _val_loss(model: torch.nn.Module) -> float:
    corpus = _example_data().ByteCorpus.from_stdlib(SMALL["--data-bytes"])
    generator = torch.Generator().manual_seed(SMALL["--seed"])  # the example's fixed validation batch
    x, y = corpus.get_batch("val", SMALL["--batch-size"], SMALL["--block-size"], generator)
    with torch.no_grad():
        logits = model.eval()(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def test_example_adapters_load_with_peft_into_a_fresh_model_with_identical_outputs(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    args = [str(a) for item in SMALL.items() for a in item]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(EXAMPLE), "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-8000:]
    printed_after = float(re.search(r"val loss after (\S+)", log).group(1))
    printed_before = float(re.search(r"val loss before (\S+)", log).group(1))
    assert len(re.findall(r"step +\d+/3 \| loss", log)) == 3, log[-4000:]
    assert re.search(r"rank 1: parameters trainable [\d.]+ KiB, frozen [\d.]+ KiB", log), log[-4000:]

    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_A" in key or "lora_B" in key for key in saved), sorted(saved)
    n_layers, n_targets = SMALL["--layers"], 7  # q, k, v, o, gate, up, down
    assert len(saved) == 2 * n_layers * n_targets, sorted(saved)

    base = AutoModelForCausalLM.from_pretrained(out / "base")
    base_loss = _val_loss(base)
    assert abs(base_loss - printed_before) < 1e-4, (base_loss, printed_before)  # the untouched base, as printed
    model = PeftModel.from_pretrained(base, out / "adapter")
    assert abs(_val_loss(model) - printed_after) < 2e-6, (_val_loss(model), printed_after)
    assert abs(base_loss - printed_after) > 1e-3, "training changed nothing the adapters could carry"
