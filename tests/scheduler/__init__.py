"""Tests of the scheduler and its lanes, CUDA's stream rules checked on CPU (fake_cuda)."""
