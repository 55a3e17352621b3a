"""Tests of composable_shard/controls/."""
