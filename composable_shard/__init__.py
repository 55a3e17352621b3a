"""Owns: the package's public face — the top-level names (``__all__``, the
contract in docs/api.md) and joining the optional wings (state-dict hooks,
guards on torch's own functions, optimizer steps) to ``fully_shard``.

composable_shard: fully sharded data parallel training as a composable API.
``fully_shard(module)`` shards a module's parameters across ranks in place and
attaches the hooks that gather them for forward and backward and reduce their
gradients. See docs/api.md for the contract.
"""

import sys as _sys

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .entry import fully_shard, is_fully_sharded, register_forward_method
from .policy import CustomPolicy, LayoutPolicy, ModuleWrapPolicy, Policy, SizeBasedPolicy, SmallUnitGroups
from . import planning
from .planning import Capacity, MemoryRecorder, ShardingPlan, describe, largest_fitting, plan
from .controls.unshard_params import clip_grad_norm_, no_sync, unshard_params
from .controls.reduction import (
    register_comm_hook,
    set_all_reduce_hook,
    set_gradient_divide_factor,
    set_requires_all_reduce,
)
from . import comm_hooks
from .controls.per_unit import (
    UnshardHandle,
    reshard,
    set_is_last_backward,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .state_dict import (
    StateDictError,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .entry import register_before_change as _register_before_change
from .entry import register_unit_extension as _register_unit_extension
from .entry import register_layout_planner as _register_layout_planner
from .planning.sharding_plan import layout_for_budget as _layout_for_budget
from .state_dict.hooks import register_state_dict_hooks as _register_state_dict_hooks
from .runtime.optimizer_checks import register_elementwise_optimizer
from .runtime.skipped_units import set_may_be_skipped
from .runtime.lifecycle import OptimizerStepExtension as _OptimizerStepExtension
from .runtime.lifecycle import register_optimizer_step_extension as _register_optimizer_step_extension
from .optim import full_shape, set_flat_step
from .optim import flat_step as _flat_step
from .optim import owner_step as _owner_step
from . import interop as interop  # the subpackage stays an attribute: composable_shard.interop
from .interop import (
    autograd_grad as _autograd_inputs,
    install as _torch_wrappers,
    param_hooks as _param_hooks,
    clip_grad as _torch_grad_norm,
)

# module.state_dict() / load_state_dict() on every unit: the state-dict wing
# joins fully_shard here, so the core never imports it.
_register_unit_extension(_register_state_dict_hooks)
# register_hook on an original parameter raises ([Note: hooks on original
# parameters]); torch's clip_grad_norm_ gives the global norm ([Note: torch's
# clip_grad_norm_ over shards]); autograd.grad over an original parameter
# raises ([Note: autograd.grad over original parameters]). torch's functions
# are replaced by the first fully_shard, not here ([Note: wrapping torch's
# functions] in interop/install.py).
_register_unit_extension(_param_hooks.guard_param_hooks)
_register_unit_extension(_torch_grad_norm.track_unit_grads)
_register_unit_extension(_autograd_inputs.track_unit_params)
_register_before_change(_torch_wrappers.before_fully_shard)
_register_unit_extension(_torch_wrappers.track_unit)
# fully_shard(..., memory_budget=...) plans the layouts with the planning wing.
_register_layout_planner(_layout_for_budget)

# ``composable_shard.plan`` is the function (docs/api.md); its subpackage is
# ``composable_shard.planning``. Code written as ``from composable_shard.plan
# import ShardingPlan`` still finds the subpackage under its old name.
_sys.modules.setdefault(f"{__name__}.plan", planning)

# Optimizers that are not elementwise step whole parameters on their owners
# ([Note: owner computes] in optim/owner_step.py).
_register_optimizer_step_extension(
    _OptimizerStepExtension(_owner_step.before_step, _owner_step.after_step, _owner_step.settle)
)
# Elementwise torch.optim optimizers step the runs of parameters that lie back
# to back in a shard as one tensor ([Note: the flat step] in optim/flat_step.py).
_register_optimizer_step_extension(
    _OptimizerStepExtension(_flat_step.before_step, _flat_step.after_step, _flat_step.settle)
)

__all__ = [
    "fully_shard",
    "is_fully_sharded",
    "register_forward_method",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "Policy",
    "ModuleWrapPolicy",
    "SizeBasedPolicy",
    "CustomPolicy",
    "LayoutPolicy",
    "SmallUnitGroups",
    "unshard_params",
    "no_sync",
    "clip_grad_norm_",
    "set_requires_all_reduce",
    "set_gradient_divide_factor",
    "register_comm_hook",
    "set_all_reduce_hook",
    "comm_hooks",
    "set_requires_gradient_sync",
    "set_is_last_backward",
    "set_reshard_after_forward",
    "set_reshard_after_backward",
    "set_modules_to_forward_prefetch",
    "set_modules_to_backward_prefetch",
    "unshard",
    "reshard",
    "UnshardHandle",
    "register_elementwise_optimizer",
    "full_shape",
    "set_flat_step",
    "set_may_be_skipped",
    "plan",
    "describe",
    "ShardingPlan",
    "largest_fitting",
    "Capacity",
    "MemoryRecorder",
    "StateDictOptions",
    "StateDictError",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
]
