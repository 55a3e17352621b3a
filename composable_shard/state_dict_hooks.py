"""Owns: nothing — the old import path of ``composable_shard.state_dict.hooks``
(module.state_dict() hooks), kept so existing imports keep working.

Knows nothing of: anything; it re-exports that module's public names.
"""

from .state_dict.hooks import *  # noqa: F401,F403 - the old path of these names
from .state_dict.hooks import __all__  # noqa: F401
