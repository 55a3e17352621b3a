"""Owns: nothing — the old import path of ``composable_shard.state_dict.shards``
(the sharded representation of one parameter), kept so existing imports keep working.

Knows nothing of: anything; it re-exports that module's public names.
"""

from .state_dict.shards import *  # noqa: F401,F403 - the old path of these names
from .state_dict.shards import __all__  # noqa: F401
