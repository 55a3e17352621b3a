"""Converting a sharded checkpoint directory to one ``torch.save`` file of the
unsharded model (original names and shapes) and back, with no process
group: ``composable_shard.checkpoint.dcp_to_torch_save`` /
``torch_save_to_dcp`` and their command line, ``scripts/convert_checkpoint.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as torch_dcp_to_torch_save

from composable_shard import get_model_state_dict, get_optimizer_state_dict, load_checkpoint, save_checkpoint
from composable_shard.checkpoint import dcp_to_torch_save, torch_save_to_dcp

from .harness import run_distributed
from .test_optim_state_dict import make_optimizer
from .test_state_dict import FULL_RANK0, BufferedGPT, assert_same_tensors, perturbed, shard, train_steps

REPO_ROOT = Path(__file__).resolve().parent.parent


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
