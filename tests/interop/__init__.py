"""Tests of composable_shard/interop/."""
