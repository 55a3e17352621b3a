"""Owns: adapters that let trainers built by others drive composable_shard.

Knows nothing of: the core's internals (each adapter uses the public API
only); importing this package imports no trainer library.

Submodules (each needs its own optional extra):
``composable_shard.integrations.lightning`` — ``ShardStrategy`` for
``lightning.pytorch.Trainer`` and ``FabricShardStrategy`` for
``lightning.fabric.Fabric`` (extra ``lightning``; see docs/lightning.md).
"""

__all__: list[str] = []
