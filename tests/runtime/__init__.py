"""Tests of the runtime: hook order, lifecycle, entry points between steps, errors,
initialisation, ignored states, and the model's lifetime."""
