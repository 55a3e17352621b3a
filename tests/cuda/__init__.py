"""Tests on a real GPU (NCCL, streams, offload fences); skipped where no GPU is present."""
