"""The Lightning strategies (composable_shard.integrations.lightning) with a
real ``lightning.pytorch.Trainer`` and ``lightning.fabric.Fabric`` on CPU
(the Trainer on a GPU too, where there is one):
parameters after every optimizer step equal one process training the
unsharded model on the global batch (accumulation, clipping, bf16-mixed),
checkpoints resume exactly (also at another world size), and misuse is
refused at setup with a clear message, after which the model still trains.

Each Trainer runs inside the harness's ranks: ``LOCAL_RANK`` tells
Lightning's default ``LightningEnvironment`` that the processes exist, and
the strategy uses the process group already there.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from composable_shard import fully_shard, is_fully_sharded, unshard_params
from composable_shard.integrations.lightning import FabricShardStrategy, ShardStrategy

from tests.support.harness_pool import requires_cuda, run_distributed
from tests.support.models import DIM, Block
from tests.support.parity import StepSlack

SAMPLES = 48  # global samples per epoch
GLOBAL_BATCH = 8
LR = 0.05
CLIP = 0.05  # small enough that every step clips
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-3}
# bf16 parameters: one bf16 step at magnitude 1 is 7.8e-3, and the ranks sum
# gradients in another order than one process (a few elements round apart).
BF16_TRUE = {"rtol": 2e-2, "atol": 1e-2}


class Regressor(pl.LightningModule):
    """Linear -> two blocks -> linear head; MSE loss; AdamW."""

    def __init__(self, shard_in_configure_model: bool = False, configure_model_shards: bool = True) -> None:
        super().__init__()
        self.shard_in_configure_model = shard_in_configure_model
        self.configure_model_shards = configure_model_shards
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, 1)
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_model(self) -> None:
        if not self.shard_in_configure_model or is_fully_sharded(self):
            return
        if self.configure_model_shards:
            for block in self.blocks:
                fully_shard(block)
            fully_shard(self)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepsUseLayers(Regressor):
    """Steps that call the layers, not ``self(...)``; a validation loss
    logged with ``sync_dist`` (the strategy's ``reduce``)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.blocks(self.inp(x))), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.head(self.blocks(self.inp(x))), y), sync_dist=True)


class AdafactorRegressor(Regressor):
    """An optimizer stepped whole on owner ranks (not elementwise)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adafactor(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def _loader(world_size: int, accumulate: int) -> DataLoader:
    per_rank = GLOBAL_BATCH // world_size // accumulate
    return DataLoader(_data(), batch_size=per_rank, shuffle=False)


class _RecordParams(Callback):
    """Full parameters after each optimizer step, and the full gradients it
    stepped with (collectives on every rank)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.seen_step = 0
        self.trainer: pl.Trainer | None = None  # set by _fit

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Lightning clips after this hook: clip as it will.
        self.grads.append(_full_grads(pl_module, trainer.gradient_clip_val))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.seen_step:
            return  # accumulating: no optimizer step yet
        self.seen_step = trainer.global_step
        with unshard_params(pl_module, writeback=False):
            self.steps.append({n: p.detach().float().clone() for n, p in pl_module.named_parameters()})


def _full_grads(module: nn.Module, clip: float | None) -> dict[str, torch.Tensor]:
    """The full gradients the next optimizer step will use (gathered: a
    collective on every rank), clipped to norm ``clip`` as
    ``torch.nn.utils.clip_grad_norm_`` would."""
    with unshard_params(module, writeback=False, with_grads=True):
        grads = {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}
    if clip is None:
        return grads
    norm = torch.nn.utils.get_total_norm(grads.values())
    coefficient = torch.clamp(clip / (norm + 1e-6), max=1.0)
    return {n: g * coefficient for n, g in grads.items()}


@dataclass
class _Reference:
    """One process's record per optimizer step: the parameters after it, the
    gradients it stepped with, and for Adam/AdamW each parameter's state
    after it with the hyperparameters it used (empty for other optimizers)."""

    steps: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    adam_states: list[dict[str, tuple[dict, dict]]] = field(default_factory=list)


@contextlib.contextmanager
def _in_harness_ranks(rank: int) -> Iterator[None]:
    """Lightning takes the existing processes (LOCAL_RANK set) and group."""
    saved = dict(os.environ)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _trainer(world_size: int, strategy: ShardStrategy, *, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    return pl.Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _reference(
    module: Regressor,
    *,
    epochs: int,
    accumulate: int = 1,
    clip: float | None = None,
    autocast: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
) -> _Reference:
    """One process, the unsharded model, the global batch: what Lightning's
    loop does (loss / accumulate, clip the norm, step, scheduler per step)
    with the module's own optimizer, on ``device``."""
    model = copy.deepcopy(module).to(device, dtype)
    optimizer = model.configure_optimizers()["optimizer"]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x_all, y_all = (t.to(device) for t in _data().tensors)
    record = _Reference()
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    for epoch in range(epochs):
        # Lightning's DistributedSampler: one permutation (seed 0 + epoch), rank r
        # takes every W-th index, so a global batch is a run of the permutation.
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        micro = GLOBAL_BATCH // accumulate
        for index in range(SAMPLES // micro):
            x, y = x_all[order[index * micro : (index + 1) * micro]], y_all[order[index * micro : (index + 1) * micro]]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = F.mse_loss(model(x.to(dtype)), y.to(dtype)) / accumulate
            loss.backward()
            if (index + 1) % accumulate:
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            record.grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
            optimizer.step()
            if adam:  # before the scheduler changes lr
                group = {k: optimizer.param_groups[0][k] for k in ("lr", "betas", "eps", "amsgrad")}
                record.adam_states.append({
                    n: ({k: v.clone() for k, v in optimizer.state[p].items()}, group) for n, p in model.named_parameters()
                })
            optimizer.zero_grad()
            scheduler.step()
            record.steps.append({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return record


def _assert_steps_equal(
    got: list[dict[str, torch.Tensor]],
    got_grads: list[dict[str, torch.Tensor]] | None,
    expected: _Reference,
    tolerance: dict[str, float],
) -> None:
    """``got``: the parameters after the reference's last ``len(got)`` steps,
    equal within ``tolerance``. With ``got_grads``, the gradients of every
    one of the reference's steps from the first (a resumed run's first ones
    are the saving run's), also beyond what Adam's steps amplify of the
    gradients' round-off ([Note: parity after an adaptive step] in
    tests/support/parity.py): the fp32 runs. The bf16 ones compare within
    their tolerance alone, which covers a bf16 step (that bound's first
    order would not hold at bf16's round-off)."""
    assert len(expected.steps) >= len(got), (len(expected.steps), len(got))
    assert got_grads is None or len(got_grads) == len(expected.steps), (len(got_grads), len(expected.steps))
    slack = StepSlack()
    first_compared = len(expected.steps) - len(got)
    for step, theirs in enumerate(expected.steps):
        if got_grads is not None:
            for name, grad in expected.grads[step].items():
                slack.record_grad(name, got_grads[step][name], grad)
            for name, (state, group) in (expected.adam_states[step] if expected.adam_states else {}).items():
                slack.account_state(name, state, group)
        if step < first_compared:
            continue
        ours = got[step - first_compared]
        assert ours.keys() == theirs.keys()
        for name in ours:
            slack.assert_param_close(name, ours[name], theirs[name], **tolerance, when=f"step {step}")


def _fit(
    rank: int, world_size: int, module: Regressor, strategy: ShardStrategy, *, accumulate: int = 1, **kwargs: Any
) -> _RecordParams:
    recorder = _RecordParams()
    callbacks = [recorder, *kwargs.pop("callbacks", [])]
    ckpt_path = kwargs.pop("ckpt_path", None)
    val_loader = kwargs.pop("val_dataloaders", None)
    with _in_harness_ranks(rank):
        trainer = _trainer(world_size, strategy, accumulate_grad_batches=accumulate, callbacks=callbacks, **kwargs)
        trainer.fit(module, _loader(world_size, accumulate), val_loader, ckpt_path=ckpt_path)
    recorder.trainer = trainer  # for the caller's save_checkpoint
    return recorder


# ------------------------------------------------------------------ parity
def _trainer_matches_reference(rank: int, world_size: int) -> None:
    # Policy given to the strategy; plain fp32; steps that call the layers; validation.
    torch.manual_seed(0)
    module = StepsUseLayers()
    expected = _reference(module, epochs=1)
    val_x, val_y = _data().tensors[0][:16], _data().tensors[1][:16]
    val_loader = DataLoader(TensorDataset(val_x, val_y), batch_size=16 // world_size // 2)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), val_dataloaders=val_loader)
    _assert_steps_equal(recorder.steps, recorder.grads, expected, TIGHT)
    final = Regressor()
    final.load_state_dict(expected.steps[-1])
    with torch.no_grad():
        expected_val = F.mse_loss(final(val_x), val_y)
    assert recorder.trainer is not None
    torch.testing.assert_close(recorder.trainer.callback_metrics["val_loss"], expected_val, **TIGHT)
    with _in_harness_ranks(rank):  # the same Trainer again: setup finds the module sharded
        (metrics,) = recorder.trainer.validate(module, val_loader, verbose=False)
    torch.testing.assert_close(torch.tensor(metrics["val_loss"]), expected_val, **TIGHT)

    # configure_model shards; accumulate 2 micro-batches; clip the global norm.
    torch.manual_seed(0)
    module = Regressor(shard_in_configure_model=True)
    expected = _reference(module, epochs=1, accumulate=2, clip=CLIP)
    recorder = _fit(rank, world_size, module, ShardStrategy(), accumulate=2, gradient_clip_val=CLIP)
    _assert_steps_equal(recorder.steps, recorder.grads, expected, TIGHT)

    # bf16-mixed: autocast over fp32 parameters, fp32 reduction.
    torch.manual_seed(0)
    module = Regressor()
    expected = _reference(module, epochs=1, autocast=True)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), precision="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in module.parameters())
    _assert_steps_equal(recorder.steps, None, expected, BF16)

    # bf16-true: the module is converted to bf16, then sharded.
    torch.manual_seed(0)
    module = Regressor()
    expected = _reference(module, epochs=1, dtype=torch.bfloat16)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), precision="bf16-true")
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    _assert_steps_equal(recorder.steps, None, expected, BF16_TRUE)


@pytest.mark.parametrize("world_size", [1, 2])
def test_trainer_matches_one_process_on_the_global_batch(world_size: int) -> None:
    run_distributed(_trainer_matches_reference, world_size, timeout=300)


def _trainer_on_a_gpu_matches_reference(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    # fp32: the policy given to the strategy; the module built on the CPU.
    torch.manual_seed(0)
    module = Regressor()
    expected = _reference(module, epochs=1, device=device)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), accelerator="gpu")
    assert {p.device for p in module.parameters()} == {device}
    _assert_steps_equal(recorder.steps, recorder.grads, expected, TIGHT)

    # bf16-mixed: autocast on the device over fp32 parameters.
    torch.manual_seed(0)
    module = Regressor()
    expected = _reference(module, epochs=1, autocast=True, device=device)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), precision="bf16-mixed", accelerator="gpu")
    assert all(p.dtype == torch.float32 for p in module.parameters())
    _assert_steps_equal(recorder.steps, None, expected, BF16)


@requires_cuda
def test_trainer_on_a_gpu_matches_one_process_on_the_gpu() -> None:
    """``accelerator="gpu"``: NCCL, the rank's CUDA device, the loop above."""
    run_distributed(_trainer_on_a_gpu_matches_reference, 1, backend="nccl", timeout=300)


def _whole_parameter_optimizer_matches_reference(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    module = AdafactorRegressor()
    expected = _reference(module, epochs=1, clip=CLIP)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}), gradient_clip_val=CLIP)
    _assert_steps_equal(recorder.steps, recorder.grads, expected, TIGHT)


def test_an_optimizer_stepped_by_owners_through_configure_optimizers() -> None:
    """Adafactor (row and column factors: not elementwise) with an LR
    scheduler and clipping, through configure_optimizers, in parity."""
    run_distributed(_whole_parameter_optimizer_matches_reference, 2, timeout=300)


# ------------------------------------------------------------- checkpoints
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def _save_after_one_epoch(rank: int, world_size: int, directory: str) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """Epoch 1 with ModelCheckpoint, then trainer.save_checkpoint too; the
    files' names and the gradients of the epoch's steps."""
    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1, save_last=True)
    recorder = _fit(rank, world_size, Regressor(), ShardStrategy(policy={Block}), callbacks=[checkpoints],
                    enable_checkpointing=True)
    assert recorder.trainer is not None
    with _in_harness_ranks(rank):
        recorder.trainer.save_checkpoint(Path(directory) / "manual.ckpt")
        recorder.trainer.strategy.save_full_state_dict(Path(directory) / "full.pt")
    # The single-file export loads into the unsharded module (any process).
    plain = Regressor()
    plain.load_state_dict(torch.load(Path(directory) / "full.pt", weights_only=True))
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param, recorder.steps[-1][name], rtol=0, atol=0)
    return sorted(p.name for p in Path(directory).iterdir()), recorder.grads


def _resume_matches_uninterrupted(
    rank: int, world_size: int, directory: str, checkpoint: str, saved_grads: list[dict[str, torch.Tensor]]
) -> None:
    torch.manual_seed(0)
    expected = _reference(Regressor(), epochs=2)
    # "last": Lightning finds last.ckpt through the ModelCheckpoint's directory.
    options: dict[str, Any] = {"ckpt_path": checkpoint}
    if checkpoint == "last":
        options.update(callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)], enable_checkpointing=True)
    else:
        options["ckpt_path"] = str(Path(directory) / checkpoint)
        assert Path(options["ckpt_path"]).is_dir(), checkpoint
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    recorder = _fit(rank, world_size, Regressor(), ShardStrategy(policy={Block}), max_epochs=2, **options)
    assert recorder.trainer is not None and recorder.trainer.global_step == 2 * STEPS_PER_EPOCH
    assert len(recorder.steps) == STEPS_PER_EPOCH
    _assert_steps_equal(recorder.steps, saved_grads + recorder.grads, expected, TIGHT)


def test_checkpoint_resumes_exactly_at_the_same_and_another_world_size(tmp_path: Path) -> None:
    names, grads = run_distributed(_save_after_one_epoch, 2, str(tmp_path), timeout=300)[0]
    assert names == [f"epoch=0-step={STEPS_PER_EPOCH}.ckpt", "full.pt", "last.ckpt", "manual.ckpt"], names
    assert len(grads) == STEPS_PER_EPOCH
    run_distributed(_resume_matches_uninterrupted, 1, str(tmp_path), "manual.ckpt", grads, timeout=300)
    run_distributed(_resume_matches_uninterrupted, 2, str(tmp_path), "last", grads, timeout=300)


# ------------------------------------------------------------------ Fabric
def _fabric_matches_reference(rank: int, world_size: int, directory: str) -> None:
    torch.manual_seed(0)
    module = Regressor()
    model = copy.deepcopy(module)  # a plain nn.Module use of the same layers
    expected = _reference(module, epochs=2, accumulate=2, clip=CLIP)
    reference_norms = _reference_norms(module, accumulate=2)
    with _in_harness_ranks(rank):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy(policy={Block}))
        fabric.launch()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        model, optimizer = fabric.setup(model, optimizer)
        # The sampler the Trainer uses (shuffled, seed 0), its epoch set here (a
        # loader Fabric wraps would count epochs by iterations of it).
        sampler = DistributedSampler(_data(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world_size // 2, sampler=sampler)
        got, got_grads, norms = [], [], []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for index, (x, y) in enumerate(loader):
                last = (index + 1) % 2 == 0
                with fabric.no_backward_sync(model, enabled=not last):
                    fabric.backward(F.mse_loss(model(x), y) / 2)
                if not last:
                    continue
                got_grads.append(_full_grads(model.module, CLIP))
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                with unshard_params(model.module, writeback=False):
                    got.append({n: p.detach().clone() for n, p in model.module.named_parameters()})
                if epoch == 0 and len(got) == STEPS_PER_EPOCH:
                    fabric.save(Path(directory) / "fabric", {"model": model, "optimizer": optimizer,
                                                             "scheduler": scheduler, "epoch": epoch})
        _assert_steps_equal(got, got_grads, expected, TIGHT)
        torch.testing.assert_close(torch.tensor(norms[:1]), torch.tensor(reference_norms[:1]), rtol=1e-5, atol=0)

        # Load into a fresh model, optimizer and scheduler; the second epoch again.
        torch.manual_seed(5)
        fresh = Regressor()
        optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        fresh_model, optimizer = fabric.setup(fresh, optimizer)
        state = {"model": fresh_model, "optimizer": optimizer, "scheduler": scheduler, "epoch": -1}
        assert fabric.load(Path(directory) / "fabric", state) == {}
        assert state["epoch"] == 0
        resumed, resumed_grads = [], []
        sampler.set_epoch(1)
        for index, (x, y) in enumerate(loader):
            with fabric.no_backward_sync(fresh_model, enabled=index % 2 == 0):
                fabric.backward(F.mse_loss(fresh_model(x), y) / 2)
            if index % 2 == 0:
                continue
            resumed_grads.append(_full_grads(fresh, CLIP))
            fabric.clip_gradients(fresh_model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            with unshard_params(fresh, writeback=False):
                resumed.append({n: p.detach().clone() for n, p in fresh.named_parameters()})
        _assert_steps_equal(resumed, got_grads[:STEPS_PER_EPOCH] + resumed_grads, expected, TIGHT)


def _reference_norms(module: Regressor, *, accumulate: int) -> list[float]:
    """The first step's gradient norm one process computes (before clipping)."""
    model = copy.deepcopy(module)
    x_all, y_all = _data().tensors
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    micro = GLOBAL_BATCH // accumulate
    for index in range(accumulate):
        rows = order[index * micro : (index + 1) * micro]
        (F.mse_loss(model(x_all[rows]), y_all[rows]) / accumulate).backward()
    return [float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))]


@pytest.mark.parametrize("world_size", [1, 2])
def test_fabric_setup_backward_clip_save_load_match_one_process(world_size: int, tmp_path: Path) -> None:
    run_distributed(_fabric_matches_reference, world_size, str(tmp_path), timeout=300)


# ------------------------------------------------------------------ misuse
def _misuse_is_refused_at_setup_then_trains(rank: int, world_size: int) -> None:
    cases: list[tuple[Regressor, ShardStrategy, dict[str, Any], type[Exception], str]] = [
        (Regressor(), ShardStrategy(policy={Block}), {"precision": "64-true"}, ValueError,
         "ShardStrategy: precision='64-true' is not supported. Use one of ['32-true', 'bf16-mixed', 'bf16-true']"),
        (Regressor(shard_in_configure_model=True, configure_model_shards=False), ShardStrategy(), {}, ValueError,
         "ShardStrategy: Regressor has no module that fully_shard made a unit after configure_model"),
        (Regressor(), ShardStrategy(policy={nn.GRU}), {}, ValueError,
         "ShardStrategy: policy={<class 'torch.nn.modules.rnn.GRU'>} picks no module of Regressor"),
        (Regressor(shard_in_configure_model=True), ShardStrategy(policy={Block}), {}, ValueError,
         "ShardStrategy: Regressor was already given to fully_shard (in configure_model) and the strategy has policy"),
        (Regressor(shard_in_configure_model=True), ShardStrategy(), {"precision": "bf16-true"}, ValueError,
         "ShardStrategy: precision 'bf16-true' needs torch.bfloat16 parameters, but Regressor was sharded"),
    ]
    for module, strategy, kwargs, error, message in cases:
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        with pytest.raises(error, match=re.escape(message)):
            _fit(rank, world_size, module, strategy, **kwargs)
        if not any(is_fully_sharded(m) for m in module.modules()):
            assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # untouched
    with pytest.raises(TypeError, match=re.escape("ShardStrategy: unknown keyword argument(s) ['polcy']")):
        ShardStrategy(polcy={Block})
    with _in_harness_ranks(rank):
        with pytest.raises(ValueError, match=re.escape("FabricShardStrategy: precision='16-true' is not supported")):
            Fabric(accelerator="cpu", devices=world_size, precision="16-true", strategy=FabricShardStrategy())
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy())
        fabric.launch()
        plain = Regressor()
        with pytest.raises(ValueError, match=re.escape(
            "FabricShardStrategy: Regressor has no module that fully_shard made a unit after the code before "
            "fabric.setup"
        )):
            fabric.setup(plain)
        assert not any(is_fully_sharded(m) for m in plain.modules())
    # The refused (unsharded) module still trains, with a valid setup.
    module = cases[0][0]
    expected = _reference(module, epochs=1)
    recorder = _fit(rank, world_size, module, ShardStrategy(policy={Block}))
    _assert_steps_equal(recorder.steps, recorder.grads, expected, TIGHT)


def test_misuse_is_refused_at_setup_with_a_clear_message() -> None:
    run_distributed(_misuse_is_refused_at_setup_then_trains, 2, timeout=300)


# ------------------------------------------------------- Lightning's launcher
_SCRIPT = """
import warnings
warnings.simplefilter("ignore")
import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from composable_shard import unshard_params
from composable_shard.integrations.lightning import ShardStrategy

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x):
        return x + torch.tanh(self.fc(x))

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 1)
    def forward(self, x):
        return self.head(self.blocks(x))
    def training_step(self, batch, index):
        return F.mse_loss(self(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    torch.manual_seed(0)
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ShardStrategy(policy={Block}), max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4))
    with unshard_params(model, writeback=False):
        total = float(sum(p.double().sum() for p in model.parameters()))
    with open(f"result{dist.get_rank()}.txt", "w") as out:  # one file per rank: their stdouts interleave
        out.write(f"{dist.get_rank()} {dist.get_world_size()} {trainer.global_step} {total!r}")
"""


def test_lightning_launches_the_ranks_and_the_strategy_joins_them(tmp_path: Path) -> None:
    """The user's path: one ``python train.py``; Lightning starts the second
    process, the strategy creates the gloo group, both ranks end equal."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    results = sorted(path.read_text().split() for path in tmp_path.glob("result*.txt"))
    assert done.returncode == 0 and len(results) == 2, done.stdout[-2000:] + done.stderr[-4000:]
    assert [r[:3] for r in results] == [["0", "2", "2"], ["1", "2", "2"]], results
    assert results[0][3] == results[1][3], results
