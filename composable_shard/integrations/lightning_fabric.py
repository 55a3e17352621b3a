"""Owns: ``FabricShardStrategy``, the ``lightning.fabric.Fabric`` strategy
that shards the module given to ``fabric.setup`` with composable_shard and
serves ``fabric.backward``, ``no_backward_sync``, ``clip_gradients``,
``save`` and ``load``.

Knows nothing of: the Trainer (lightning.py); composable_shard's internals
(public API only).

Public names: ``FabricShardStrategy`` (import it from
``composable_shard.integrations.lightning``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.data import AttributeDict
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from composable_shard.checkpoint import load_checkpoint, save_checkpoint
from composable_shard.controls.unshard_params import clip_grad_norm_

from .lightning_common import (
    ShardOptions,
    check_half_precision_module,
    checkpoint_optimizers,
    check_precision,
    gradient_sync_disabled,
    has_units,
    shard_module,
)

__all__ = ["FabricShardStrategy"]

logger = logging.getLogger(__name__)

_OWNER = "FabricShardStrategy"
# extra_state key recording which entries of Fabric's state were the model,
# the optimizer and other stateful objects (so load puts each back).
_LAYOUT_KEY = "composable_shard.fabric_layout"


class _ShardHalfPrecision(HalfPrecision):
    """precision="bf16-true": converts a module before it is sharded; a
    sharded one must already hold bf16 parameters."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        if check_half_precision_module(_OWNER, module, self._desired_input_dtype):
            return super().convert_module(module)
        return module


def _shard_precision(plugin: Precision | None) -> Precision | None:
    if plugin is None:
        return None
    precision = str(getattr(plugin, "precision", "32-true"))
    check_precision(_OWNER, precision)
    if type(plugin) is HalfPrecision:
        return _ShardHalfPrecision("bf16-true")
    if type(plugin) in (Precision, MixedPrecision, _ShardHalfPrecision):
        return plugin
    raise ValueError(
        f"{_OWNER}: the precision plugin {type(plugin).__name__} is not supported. Pass Fabric(precision=...) "
        "with one of '32-true', 'bf16-mixed', 'bf16-true' and no precision plugin."
    )


class _UnitGradientSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: local accumulation on every unit."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled or not has_units(module):
            return contextlib.nullcontext()
        return gradient_sync_disabled(module)


class FabricShardStrategy(ParallelStrategy):
    """``fabric.setup(model, optimizer)`` shards ``model`` by ``policy``
    (``fully_shard(model, policy=..., **fully_shard_kwargs)``), or, with no
    policy, takes a model the user already gave to ``fully_shard``; a model
    with no unit is refused. ``clip_gradients(..., max_norm=)`` returns the
    global norm; ``save`` / ``load`` write and read a checkpoint directory
    (one model and its optimizers per checkpoint).

    Takes the same arguments as ``ShardStrategy``.
    """

    def __init__(
        self,
        policy: Any = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
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
            precision=precision,
        )
        self._options = ShardOptions(_OWNER, policy, fully_shard_kwargs)
        self._num_nodes = 1  # set by Fabric (num_nodes=)
        self._process_group_backend = process_group_backend  # resolved in setup_environment
        self._timeout = timeout
        self._checkpoint_safe_globals = (AttributeDict, *checkpoint_safe_globals)
        self._backward_sync_control = _UnitGradientSync()

    # The precision is checked (and "bf16-true" replaced by the checking
    # plugin) when Fabric hands it over, before any module is converted.
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = _shard_precision(precision)

    # ------------------------------------------------------------ topology
    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{_OWNER}: no devices yet; Fabric sets them when it is built.")
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True  # Fabric gives each rank a DistributedSampler over its part of the data

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

    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError(f"{_OWNER}: no cluster environment; Fabric sets one when it is built.")
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is None:
            raise RuntimeError(f"{_OWNER}: no cluster environment; Fabric sets one when it is built.")
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # set on the decorator, as Lightning does
        utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    # ------------------------------------------------------------- model
    def setup_module(self, module: nn.Module) -> nn.Module:
        shard_module(self._options, module, hook="the code before fabric.setup")
        return module

    def module_to_device(self, module: nn.Module) -> None:
        if not has_units(module):
            module.to(self.root_device)
            return
        elsewhere = [(n, p.device) for n, p in module.named_parameters() if p.device != self.root_device]
        if elsewhere:
            name, device = elsewhere[0]
            raise ValueError(
                f"{_OWNER}: '{name}' is on {device} after fully_shard, not on this rank's device "
                f"{self.root_device}; a sharded module cannot be moved. Build it on the device (or pass "
                "device_id= to fully_shard) before fabric.setup."
            )

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's shards; returns it."""
        self.precision.unscale_gradients(optimizer)
        total_norm = clip_grad_norm_(module, float(max_norm), float(norm_type))
        if error_if_nonfinite and not math.isfinite(float(total_norm)):  # host sync: one scalar
            raise RuntimeError(
                f"{_OWNER}.clip_gradients: the total gradient norm is {float(total_norm)}; the gradients were "
                "scaled by it anyway. Pass error_if_nonfinite=False to allow it."
            )
        return total_norm

    # ------------------------------------------------------- collectives
    def all_reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
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

    # -------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | torch.optim.Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write a checkpoint directory: the one model, its optimizers, and
        the other entries (stateful ones by their ``state_dict()``) as
        ``extra_state``. Collective."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"{_OWNER}.save: storage_options and filter are not supported (the checkpoint is a directory "
                "written by composable_shard.save_checkpoint)."
            )
        layout = _Layout.of(state)
        extra: dict[str, Any] = {_LAYOUT_KEY: layout.as_dict()}
        for key, value in state.items():
            if key not in layout.owned:
                extra[key] = value.state_dict() if key in layout.stateful else value
        save_checkpoint(
            Path(self.broadcast(str(path))),
            layout.module_of(state),
            checkpoint_optimizers(layout.optimizers_of(state)),
            extra_state=extra,
        )

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, nn.Module | torch.optim.Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a directory ``save`` wrote into ``state``'s model, optimizers
        and stateful objects, put its plain entries into ``state``, and
        return the entries ``state`` did not ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{_OWNER}.load: pass the state to restore, e.g. fabric.load(path, {{'model': model, "
                "'optimizer': optimizer}}) (a checkpoint directory loads into a sharded model)."
            )
        layout = _Layout.of(state)
        extra = load_checkpoint(
            Path(self.broadcast(str(path))),
            layout.module_of(state),
            checkpoint_optimizers(layout.optimizers_of(state)),
            strict=strict,
            safe_globals=self._checkpoint_safe_globals,
        )
        saved_layout = extra.pop(_LAYOUT_KEY, None)
        if saved_layout is not None and saved_layout["optimizers"] != layout.optimizers:
            logger.warning("%s.load: optimizers saved as %s, loaded into %s (in that order)",
                           _OWNER, saved_layout["optimizers"], layout.optimizers)
        missing = [k for k in state if k not in layout.owned and k not in extra]
        if strict and missing:
            raise KeyError(f"{_OWNER}.load: the checkpoint at '{path}' has no entries {missing}. Pass strict=False.")
        for key in list(state):
            if key in layout.owned or key not in extra:
                continue
            value = extra.pop(key)
            if key in layout.stateful:
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return extra


class _Layout:
    """Which entries of a Fabric state dict are the model, the optimizers
    (in the state's order) and other objects with ``state_dict`` /
    ``load_state_dict``."""

    def __init__(self, module: str, optimizers: list[str], stateful: list[str]) -> None:
        self.module = module
        self.optimizers = optimizers
        self.stateful = stateful
        self.owned = {module, *optimizers}  # entries the checkpoint directory itself holds

    @classmethod
    def of(cls, state: dict[str, Any]) -> _Layout:
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        if len(modules) != 1:
            raise ValueError(
                f"{_OWNER}: a checkpoint holds one model; the state has models {modules}. Save the others in "
                "checkpoints of their own."
            )
        stateful = [
            k
            for k, v in state.items()
            if k not in modules + optimizers
            and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None))
        ]
        return cls(modules[0], optimizers, stateful)

    def module_of(self, state: dict[str, Any]) -> nn.Module:
        module = state[self.module]
        if not isinstance(module, nn.Module):
            raise TypeError(f"{_OWNER}: state[{self.module!r}] is not a module.")
        return module

    def optimizers_of(self, state: dict[str, Any]) -> list[torch.optim.Optimizer]:
        return [state[key] for key in self.optimizers]

    def as_dict(self) -> dict[str, Any]:
        return {"module": self.module, "optimizers": list(self.optimizers), "stateful": list(self.stateful)}
