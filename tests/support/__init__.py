"""Owns: the machinery the tests share — the multi-process harness (harness_pool.py on the
pytest side, harness_worker.py in the workers), the models, the parity runners and
references, spies, fakes, and the scripts run as jobs of their own (fault_job.py,
multinode_job.py, plan_measure.py).

Knows nothing of: the tests that use it; no module here imports a test module.
"""
