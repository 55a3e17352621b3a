"""Tests of the collectives and transports (composable_shard/comm/), failures of peers, and
process groups across nodes."""
