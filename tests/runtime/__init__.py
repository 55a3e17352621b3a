"""Tests of the runtime: hook order, lifecycle, entry points between steps, errors,\ninitialisation, ignored states, and the model's lifetime."""
