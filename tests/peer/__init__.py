"""Ports of PyTorch FSDP2's test scenarios (see SCENARIOS.md) and comparisons with FSDP1."""
