"""Tests of the package's layout, read from its source (the import graph)."""
