"""Tests of the sharding plan and its capacity search."""
