"""Tests of composable_shard/optim/: optimizers that step whole parameters on owner ranks."""
