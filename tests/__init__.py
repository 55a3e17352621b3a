"""Owns: the composable_shard test suite (a package, as is every folder in it, so that
worker processes can import test modules by their dotted name ``tests.<subject>.<module>``).

Layout: one folder per subject (runtime, training, state_dict, checkpoint, comm,
scheduler, handle, plan, peer, cuda, examples, bench, harness, layout); the machinery
they share in ``tests/support/``; fixtures shared by every test in conftest.py. No test
module imports another.

Knows nothing of: how the library is built; see ``tests/support/harness_pool.py`` for the
multi-process harness every distributed test runs on.
"""
