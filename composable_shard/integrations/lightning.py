"""Owns: ``ShardStrategy``, the ``lightning.pytorch.Trainer`` strategy that
trains a LightningModule sharded by composable_shard (and the public face of
the Lightning integration: ``FabricShardStrategy`` is defined in
lightning_fabric.py and importable from here).

Knows nothing of: composable_shard's internals (public API only); Fabric's
wrappers (lightning_fabric.py).

Public names: ``ShardStrategy``, ``FabricShardStrategy``. Needs the
``lightning`` extra (``pip install composable_shard[lightning]``, lightning
2.6). docs/lightning.md lists the Trainer options honoured and refused.

[Note: what the Trainer asks of the strategy]
Lightning's loops call the strategy at fixed points; each maps to one public
composable_shard function:
- ``setup``: after the module's ``configure_model`` ran (under
  ``tensor_init_context``, so on the root device and in the precision's
  dtype), shard by ``policy`` or check that ``configure_model`` did;
  then build the optimizers over the (same) parameters.
- ``block_backward_sync`` (the loop's context while it accumulates
  gradients): ``set_requires_gradient_sync(False)`` on every unit, so only
  the last micro-batch's backward reduces (the sum).
- the precision plugin's ``clip_grad_by_norm`` (``gradient_clip_val`` with
  the norm algorithm): ``clip_grad_norm_`` over the whole sharded module, the
  norm one process with the full model would compute.
- ``lightning_module_state_dict`` / ``optimizer_state``: the sharded state
  dicts; ``save_checkpoint`` / ``load_checkpoint``: a checkpoint directory
  (model, optimizer, and the rest of Lightning's checkpoint dict as
  ``extra_state``), loaded after ``setup`` (``restore_checkpoint_after_setup``)
  straight into the shards, at any world size.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.data import AttributeDict
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from composable_shard.checkpoint import load_checkpoint, save_checkpoint
from composable_shard.controls.unshard_params import clip_grad_norm_
from composable_shard.entry import is_fully_sharded, register_forward_method
from composable_shard.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from .lightning_common import (
    ShardOptions,
    check_half_precision_module,
    check_precision,
    gradient_sync_disabled,
    has_units,
    shard_module,
    checkpoint_optimizers,
)
from .lightning_fabric import FabricShardStrategy

__all__ = ["ShardStrategy", "FabricShardStrategy"]

logger = logging.getLogger(__name__)

_OWNER = "ShardStrategy"
# The LightningModule's methods that Lightning calls instead of forward.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class _GlobalNormClipping(Precision):
    """Lightning's precision plugin with ``clip_grad_by_norm`` over the
    sharded module's global gradient norm (the Trainer clips through it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharded_module: nn.Module | None = None  # set by ShardStrategy.setup

    def optimizer_step(  # type: ignore[override]  # Lightning's Steppable/Optimizable protocols
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Forward and backward (the closure, with Lightning's hooks and
        clipping after it), then ``optimizer.step()`` without a closure: an
        optimizer that steps whole parameters on owner ranks refuses one
        ([Note: owner computes] in composable_shard/optim/owner_step.py), and
        for every other optimizer this is the same order of work. LBFGS calls
        its closure several times: Lightning's own path."""
        calls_closure_repeatedly = isinstance(optimizer, torch.optim.LBFGS)  # (no narrowing: Lightning's protocols)
        if calls_closure_repeatedly:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = self._wrap_closure(model, optimizer, closure)
        optimizer.step(**kwargs)
        return closure_result

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        if self.sharded_module is None:
            raise RuntimeError(f"{_OWNER}: gradients clipped before the strategy's setup sharded the model.")
        clip_grad_norm_(self.sharded_module, float(clip_val))


class _ShardFullPrecision(_GlobalNormClipping, Precision):
    """precision="32-true"."""


class _ShardMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """precision="bf16-mixed": autocast over fp32 parameters and gradients."""


class _ShardHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """precision="bf16-true": the module converted before it is sharded."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        if check_half_precision_module(_OWNER, module, self._desired_input_dtype):
            return super().convert_module(module)
        return module


def _shard_precision(plugin: Precision) -> _GlobalNormClipping:
    """The strategy's own plugin for Lightning's ``plugin`` (refusing a
    precision or a plugin class it does not run)."""
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    precision = str(getattr(plugin, "precision", "32-true"))
    check_precision(_OWNER, precision)
    if type(plugin) is Precision:
        return _ShardFullPrecision()
    if type(plugin) is MixedPrecision and precision == "bf16-mixed":
        return _ShardMixedPrecision("bf16-mixed", plugin.device)
    if type(plugin) is HalfPrecision and precision == "bf16-true":
        return _ShardHalfPrecision("bf16-true")
    raise ValueError(
        f"{_OWNER}: the precision plugin {type(plugin).__name__} is not supported. Pass Trainer(precision=...) "
        "with one of '32-true', 'bf16-mixed', 'bf16-true' and no precision plugin."
    )


class ShardStrategy(ParallelStrategy):
    """Train a LightningModule with its parameters sharded by composable_shard.

    ``ShardStrategy(policy={Block})`` calls ``fully_shard(module,
    policy={Block}, **fully_shard_kwargs)`` on the LightningModule at setup;
    ``ShardStrategy()`` leaves sharding to the module's ``configure_model``
    (which calls ``fully_shard`` on its blocks and on the module that holds
    them). A model with no unit after that is refused at setup, as are
    precisions other than "32-true", "bf16-mixed", "bf16-true".

    Args:
        policy: units to make (a composable_shard ``Policy`` or a set of
            module classes), or ``None`` to let ``configure_model`` shard.
        process_group_backend: defaults to "nccl" on CUDA, "gloo" on CPU.
        timeout: the process group's timeout.
        checkpoint_safe_globals: extra types a resumed checkpoint's
            Lightning state may hold (loading admits plain data only).
        **fully_shard_kwargs: ``fully_shard``'s keyword arguments
            (``strategy``, ``mixed_precision``, ``device_mesh``, ...).
    """

    strategy_name = "composable_shard"

    def __init__(
        self,
        policy: Any = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_safe_globals: tuple[Any, ...] = (),
        **fully_shard_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._options = ShardOptions(_OWNER, policy, fully_shard_kwargs)
        self._num_nodes = 1  # set by the Trainer (num_nodes=)
        self._process_group_backend = process_group_backend  # resolved in setup_environment
        self._timeout = timeout
        # Lightning's own checkpoint entries (hyper-parameters) plus the user's.
        self._checkpoint_safe_globals = (AttributeDict, *checkpoint_safe_globals)
        # The module this strategy sharded by its policy (a later setup of the
        # same Trainer, for validate or test, finds it sharded and goes on).
        self._sharded_by_policy: nn.Module | None = None

    # ------------------------------------------------------------ topology
    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{_OWNER}: no devices yet; the Trainer sets them when it is built.")
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True  # Trainer gives each rank a DistributedSampler over its part of the data

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads straight into the shards and the built optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored them

    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError(f"{_OWNER}: no cluster environment; the Trainer sets one when it is built.")
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # set on the decorator, as Lightning does
        utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        # Refuse an unsupported precision before the process group or the model is touched.
        self.precision_plugin = _shard_precision(self.precision_plugin)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        if self.cluster_environment is None:
            raise RuntimeError(f"{_OWNER}: no cluster environment; the Trainer sets one when it is built.")
        # An existing default group (a launcher of the user's, or a test harness) is used as it is.
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    # --------------------------------------------------------------- setup
    def setup(self, trainer: Trainer) -> None:
        module = self._module("setup")
        if self.accelerator is None:
            raise RuntimeError(f"{_OWNER}: no accelerator; the Trainer sets one when it is built.")
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        if not isinstance(precision, _GlobalNormClipping):
            raise RuntimeError(f"{_OWNER}: setup ran before setup_environment.")
        if module is not self._sharded_by_policy:  # a later fit/validate/test: sharded already
            if self._options.policy is not None and not has_units(module):
                precision.convert_module(module)  # "bf16-true": convert (in place), then shard
                self.model_to_device()
            shard_module(self._options, module, hook="configure_model")
            if self._options.policy is not None:
                self._sharded_by_policy = module
        precision.convert_module(module)  # "bf16-true" on a module configure_model sharded: check the dtype
        self.model_to_device()
        _route_steps_through_forward(module)
        precision.sharded_module = module
        self.barrier("ShardStrategy.setup")
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        module = self._module("model_to_device")
        if not has_units(module):
            module.to(self.root_device)
            return
        elsewhere = [(n, p.device) for n, p in module.named_parameters() if p.device != self.root_device]
        if elsewhere:
            name, device = elsewhere[0]
            raise ValueError(
                f"{_OWNER}: '{name}' is on {device} after fully_shard, not on this rank's device "
                f"{self.root_device}; a sharded module cannot be moved. Build the module in configure_model "
                "(Lightning runs it on the rank's device) or pass device_id= to fully_shard."
            )

    def _module(self, what: str) -> LightningModule:
        if self.lightning_module is None:
            raise RuntimeError(f"{_OWNER}.{what}: no LightningModule is connected yet.")
        return self.lightning_module

    # ------------------------------------------------------------ training
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        module = self._module("block_backward_sync")
        if not has_units(module):
            yield None
            return
        with gradient_sync_disabled(module):
            yield None

    # ------------------------------------------------------- collectives
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------- states
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded model state dict (each rank its parts; DCP saves it)."""
        return get_model_state_dict(self._module("lightning_module_state_dict"))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The sharded optimizer state dict, keyed by parameter name."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self._module("optimizer_state"), optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint directory at ``filepath``: the model's and the
        optimizer's shards, and the rest of Lightning's checkpoint dict as
        ``extra_state``. Collective (Lightning calls it on every rank)."""
        if storage_options is not None:
            raise TypeError(
                f"{_OWNER}.save_checkpoint: storage_options are not supported (the checkpoint is a directory "
                "written by composable_shard.save_checkpoint, not through a CheckpointIO plugin)."
            )
        path = Path(self.broadcast(str(filepath)))
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        has_optimizer = "optimizer_states" in checkpoint
        checkpoint.pop("optimizer_states", None)
        optimizer = checkpoint_optimizers([_unwrap(o) for o in self.optimizers]) if has_optimizer else None
        save_checkpoint(path, self._module("save_checkpoint"), optimizer, extra_state=checkpoint)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint directory into the sharded model (and the
        optimizer, while fitting) and return Lightning's part of it."""
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self._module("load_checkpoint")
        optimizer = checkpoint_optimizers([_unwrap(o) for o in self.optimizers])
        return load_checkpoint(
            path, module, optimizer, strict=module.strict_loading, safe_globals=self._checkpoint_safe_globals
        )

    def save_full_state_dict(self, filepath: _PATH) -> None:
        """Export for inference: gather the full model state dict to rank 0
        (on CPU) and save it there as one ``torch.save`` file, which the
        unsharded LightningModule loads with ``load_state_dict``. Collective:
        call ``trainer.strategy.save_full_state_dict(path)`` on every rank."""
        path = Path(self.broadcast(str(filepath)))
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self._module("save_full_state_dict"), options=options)
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, path)
        self.barrier("ShardStrategy.save_full_state_dict")

    def teardown(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()


def _route_steps_through_forward(module: LightningModule) -> None:
    """Where the LightningModule itself is a unit (the root under a policy),
    its ``*_step`` methods gather its own parameters as ``forward`` does, so
    a step may use its layers directly rather than through ``self(...)``
    (a ``self(...)`` inside a step is then a nested forward, which is fine)."""
    if not is_fully_sharded(module):
        return
    for name in _STEP_METHODS:
        if name in module.__dict__ or not is_overridden(name, module):
            continue  # routed by an earlier setup, or not the user's
        register_forward_method(module, name)
        gathering = module.__dict__[name]
        # Lightning asks is_overridden(name) on the instance; it follows
        # __wrapped__ to the class's method (the core's bound partial has no
        # __code__ to compare).
        module.__dict__[name] = functools.wraps(getattr(type(module), name))(
            lambda *args, _gathering=gathering, **kwargs: _gathering(*args, **kwargs)
        )


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
