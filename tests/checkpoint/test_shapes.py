"""What ``save_checkpoint`` stores for two kinds of parameter
(state_dict/shards.py, checkpoint/planners.py): a 0-dim parameter keeps
its shape ``()`` (model and per-element optimizer state), so the checkpoint
loads as it is into the unsharded model and into FSDP2 (which leaves a
scalar parameter unsharded); tied aliases are written once (the alias's
metadata points at the canonical name's bytes) and still read under both
names by any DCP reader. Checkpoints with the old ``(1,)`` shape still load
(tests/checkpoint/test_pickles.py loads one written by an earlier version)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_state_dict

from composable_shard import get_model_state_dict, load_checkpoint, save_checkpoint

from tests.support.harness_pool import run_distributed
from tests.support.models import BufferedGPT
from tests.support.state_dicts import FULL, assert_same_tensors, make_optimizer, shard, train_steps


def _metadata(directory: Path) -> object:
    with open(directory / ".metadata", "rb") as stream:
        return pickle.load(stream)  # noqa: S301 - written by this test


def _data_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.distcp"))


def _shapes_and_tied_aliases(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = shard(BufferedGPT(), "manual")
    optimizer = make_optimizer("adamw", model)
    train_steps(model, optimizer, range(2))
    expected = get_model_state_dict(model, options=FULL)
    directory = Path(root, "ckpt")
    save_checkpoint(directory, model, optimizer)
    metadata = _metadata(directory)
    sizes = {key: getattr(md, "size", None) for key, md in metadata.state_dict_metadata.items()}
    assert sizes["model.temperature"] == torch.Size([]), sizes["model.temperature"]
    assert sizes["optim.state.temperature.exp_avg"] == torch.Size([]), sizes["optim.state.temperature.exp_avg"]
    # The alias's records are the canonical name's: its bytes were written once.
    records = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
    tied = {offset: info for (fqn, offset), info in records.items() if fqn == "model.head.weight"}
    assert tied and tied == {offset: info for (fqn, offset), info in records.items() if fqn == "model.tok_emb.weight"}
    plain = Path(root, "plain")  # the same state through plain dcp.save: the alias written again
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=plain)
    tok_emb_bytes = expected["tok_emb.weight"].numel() * 4
    model_only = Path(root, "model_only")
    save_checkpoint(model_only, model)
    assert _data_bytes(plain) - _data_bytes(model_only) >= tok_emb_bytes, (_data_bytes(plain), _data_bytes(model_only))

    # The unsharded model loads it as it is (every rank, whole).
    unsharded = BufferedGPT()
    state = {"model": unsharded.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    unsharded.load_state_dict(state["model"], strict=True)
    assert_same_tensors(unsharded.state_dict(), expected, "unsharded model from the checkpoint")
    assert unsharded.temperature.shape == () and unsharded.head.weight is unsharded.tok_emb.weight

    # FSDP2 (the scalar left out of its sharding: it refuses scalar parameters) loads it as it is.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    peer = BufferedGPT()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in peer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(peer, mesh=mesh, ignored_params={peer.temperature})
    peer_state = {"model": torch_state_dict.get_model_state_dict(peer)}
    dcp.load(peer_state, checkpoint_id=directory)
    torch_state_dict.set_model_state_dict(peer, peer_state["model"])
    got = torch_state_dict.get_model_state_dict(peer, options=torch_state_dict.StateDictOptions(full_state_dict=True))
    assert_same_tensors({k: got[k] for k in expected}, expected, "FSDP2 model from the checkpoint")

    # And back into composable_shard, at this world size, by policy.
    torch.manual_seed(2)
    fresh = shard(BufferedGPT(), "policy")
    fresh_optimizer = make_optimizer("adamw", fresh)
    load_checkpoint(directory, fresh, fresh_optimizer)
    assert_same_tensors(get_model_state_dict(fresh, options=FULL), expected, "composable_shard from the checkpoint")
    train_steps(fresh, fresh_optimizer, range(2, 3))


def test_scalar_parameters_keep_their_shape_and_tied_aliases_are_written_once(tmp_path: Path) -> None:
    run_distributed(_shapes_and_tied_aliases, 2, str(tmp_path))
