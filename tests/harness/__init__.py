"""Tests of the multi-process test harness itself (tests/support/harness_pool.py)."""
