"""Tests of scripts/bench.py's parts (the largest-size search, the overlap report)."""
