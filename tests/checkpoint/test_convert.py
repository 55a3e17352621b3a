"""Converting a sharded checkpoint directory to one ``torch.save`` file of the
unsharded model (original names and shapes) and back, with no process
group: ``composable_shard.checkpoint.dcp_to_torch_save`` /
``torch_save_to_dcp`` and their command line, ``scripts/convert_checkpoint.py``;
and to one ``.safetensors`` file (tied weights stored once, as transformers
writes them) that the unsharded model, ``safetensors`` and ``transformers``
load with identical outputs, and back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as torch_dcp_to_torch_save

from composable_shard import (
    ModuleWrapPolicy,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from composable_shard.checkpoint import dcp_to_torch_save, torch_save_to_dcp

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT, TinyGPT
from tests.support.state_dicts import (
    FULL,
    FULL_RANK0,
    assert_same_tensors,
    make_optimizer,
    perturbed,
    shard,
    train_steps,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _save_trained(rank: int, world_size: int, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(2))
    model.counter.count = 5
    save_checkpoint(directory, model, optimizer, extra_state={"step": 2})
    return get_model_state_dict(model, options=FULL_RANK0), get_optimizer_state_dict(model, optimizer, options=FULL_RANK0)


def _load_and_return(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(1)
    model = shard(BufferedGPT(), "hybrid" if world_size > 1 else "manual")
    load_checkpoint(directory, model)
    return get_model_state_dict(model, options=FULL_RANK0)


def test_checkpoint_converts_to_one_torch_save_file_and_back(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    model_state, optim_state = run_distributed(_save_trained, 2, str(directory))[0]

    # Directory -> one file of the unsharded model, no process group.
    dcp_to_torch_save(directory, tmp_path / "model.pt")
    converted = torch.load(tmp_path / "model.pt", weights_only=False)
    assert_same_tensors(converted, model_state, "converted model")
    assert converted["temperature"].shape == ()
    plain = BufferedGPT()
    plain.load_state_dict(converted)  # the unsharded class takes it as it is
    assert plain.counter.count == 5

    # The command line, with everything (optimizer state by name, full shapes).
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "convert_checkpoint.py"), "to-torch", str(directory), str(tmp_path / "all.pt"), "--everything"],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    assert_same_tensors(everything["model"], model_state, "converted model (everything)")
    assert everything["extra"] == {"step": 2}
    for fqn, values in optim_state["state"].items():
        assert_same_tensors(dict(sorted(everything["optim"]["state"][fqn].items())), dict(sorted(values.items())), f"optimizer {fqn}")
    assert [g["params"] for g in everything["optim"]["param_groups"]] == [g["params"] for g in optim_state["param_groups"]]

    # PyTorch's own converter reads the directory too (original shapes; a
    # 0-dim parameter keeps its stored shape (1,)).
    torch_dcp_to_torch_save(directory, tmp_path / "by_torch.pt")
    by_torch = torch.load(tmp_path / "by_torch.pt", weights_only=False)["model"]
    assert by_torch["blocks.0.fc_in.weight"].shape == model_state["blocks.0.fc_in.weight"].shape
    torch.testing.assert_close(by_torch["tok_emb.weight"], model_state["tok_emb.weight"], atol=0, rtol=0)

    # One file -> a directory that loads at another world size and strategy.
    changed = perturbed(converted, 0.5)
    torch.save(changed, tmp_path / "changed.pt")
    torch_save_to_dcp(tmp_path / "changed.pt", tmp_path / "back")
    loaded = run_distributed(_load_and_return, 4, str(tmp_path / "back"))[0]
    assert_same_tensors(loaded, changed, "loaded from a converted file")


# ------------------------------------------------------------ safetensors
class UntiedGPT(TinyGPT):
    """TinyGPT with its own output head (no tied parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(self.head.in_features, self.head.out_features, bias=False)


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _save_three_models(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Tied and untied GPTs (trained) and a tied tiny Llama, each sharded and
    saved with save_checkpoint; returns their full state dicts."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, build in (("tied", TinyGPT), ("untied", UntiedGPT), ("llama", _tiny_llama)):
        torch.manual_seed(0)
        model = build()
        if name == "llama":
            fully_shard(model, policy=ModuleWrapPolicy({type(model.model.layers[0])}))
        else:
            shard(model, "manual")
            optimizer = make_optimizer("adamw", model)
            train_steps(model, optimizer, range(2))
        save_checkpoint(f"{root}/{name}", model)
        full[name] = get_model_state_dict(model, options=FULL)
    return full


def _load_back(rank: int, world_size: int, directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = shard(TinyGPT(), "policy")
    load_checkpoint(directory, model)
    return get_model_state_dict(model, options=FULL)


def _convert(*argv: str | Path, cwd: Path) -> None:
    """The command line, with FutureWarning and DeprecationWarning as errors."""
    command = [sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning"]
    command += [str(REPO_ROOT / "scripts" / "convert_checkpoint.py"), *map(str, argv)]
    result = subprocess.run(command, capture_output=True, cwd=cwd, text=True)
    assert result.returncode == 0, result.stderr


def test_checkpoint_converts_to_safetensors_loadable_by_the_unsharded_model_and_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file, load_model

    full = run_distributed(_save_three_models, 2, str(tmp_path))[0]
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    for name in ("tied", "untied", "llama"):
        _convert("to-safetensors", tmp_path / name, tmp_path / f"{name}.safetensors", cwd=tmp_path)

    # Tied: stored once under the canonical name; the model's loader (strict) ties it again.
    stored = load_file(tmp_path / "tied.safetensors")
    assert sorted(stored) == sorted(key for key in full["tied"] if key != "head.weight")
    reference = TinyGPT()
    reference.load_state_dict(full["tied"])
    plain = TinyGPT()
    missing, unexpected = load_model(plain, tmp_path / "tied.safetensors", strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    assert plain.head.weight is plain.tok_emb.weight
    torch.testing.assert_close(plain(tokens), reference(tokens), atol=0, rtol=0)

    # Untied: every key, and plain load_state_dict(load_file(...), strict=True).
    stored = load_file(tmp_path / "untied.safetensors")
    assert sorted(stored) == sorted(full["untied"])
    reference = UntiedGPT()
    reference.load_state_dict(full["untied"])
    plain = UntiedGPT()
    plain.load_state_dict(stored, strict=True)
    torch.testing.assert_close(plain(tokens), reference(tokens), atol=0, rtol=0)

    # transformers: the same keys as its own save_pretrained, and from_pretrained reads ours.
    from transformers import LlamaForCausalLM

    reference = _tiny_llama()
    reference.load_state_dict(full["llama"])
    reference.save_pretrained(tmp_path / "hf_own")
    ours = tmp_path / "hf_ours"
    reference.config.save_pretrained(ours)
    (tmp_path / "llama.safetensors").rename(ours / "model.safetensors")
    assert sorted(load_file(ours / "model.safetensors")) == sorted(load_file(tmp_path / "hf_own" / "model.safetensors"))
    loaded = LlamaForCausalLM.from_pretrained(ours).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, reference(tokens).logits, atol=0, rtol=0)
    llama_plain = _tiny_llama()
    load_model(llama_plain, ours / "model.safetensors", strict=True)
    with torch.no_grad():
        torch.testing.assert_close(llama_plain(tokens).logits, reference(tokens).logits, atol=0, rtol=0)

    # And back: a directory that load_checkpoint reads at another world size, tied alias restored.
    _convert("from-safetensors", tmp_path / "tied.safetensors", tmp_path / "back", cwd=tmp_path)
    loaded_back = run_distributed(_load_back, 4, str(tmp_path / "back"))[0]
    assert_same_tensors(loaded_back, full["tied"], "safetensors -> checkpoint -> 4 ranks")
