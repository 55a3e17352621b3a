"""Owns: the composable_shard test suite (a package, so that worker processes can import
test modules by their dotted name ``tests.<module>``).

Knows nothing of: how the library is built; see ``tests/harness.py`` for the
multi-process harness every distributed test runs on.
"""
