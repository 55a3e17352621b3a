"""Tests that run the examples as the README does."""
