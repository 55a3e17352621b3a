"""Tests of model and optimizer state dicts of a sharded tree."""
