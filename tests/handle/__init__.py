"""Tests of the flat-parameter handle library on its own, without hooks."""
