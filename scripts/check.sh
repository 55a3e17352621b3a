#!/usr/bin/env bash
# The project's checks, in CI's order: lint (ruff), type check (mypy), then the
# tests (pytest last: its result is the script's). .ci/run and the README's test
# command run `bash scripts/install.sh && bash scripts/check.sh`; install.sh
# installs the pinned ruff and mypy (the `lint` extra). Configuration: the
# [tool.ruff] and [tool.mypy] tables of pyproject.toml.
#
# Usage (from anywhere): bash scripts/check.sh [pytest arguments]
#   e.g. bash scripts/check.sh tests/handle     Override the interpreter: PYTHON=...
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"

"$PYTHON" -m ruff check composable_shard tests scripts examples
"$PYTHON" -m mypy  # the package (files = ["composable_shard"] in pyproject.toml)
exec "$PYTHON" -m pytest -q "$@"
