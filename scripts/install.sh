#!/usr/bin/env bash
# Installs composable_shard (editable), its test dependencies and the pinned lint
# tools (ruff, mypy: the `lint` extra) into the current
# python3's environment. Safe to run again: pip leaves satisfied requirements alone.
#
# torch is pinned here, not in pyproject.toml: `torch==2.13.0` resolves to the CPU
# wheel kept on this kind of machine, while an open `torch` range would let pip pull
# a multi-GB CUDA build. An already installed torch is kept whatever its version.
#
# Usage (from anywhere): bash scripts/install.sh        Override the interpreter: PYTHON=...
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_ROOT_USER_ACTION=ignore  # CI runs as root; the warning is noise there
pip_install=("$PYTHON" -m pip install --quiet)

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "install.sh: torch not importable; installing torch==${TORCH_VERSION} (CPU build)"
    # numpy: torch warns "Failed to initialize NumPy" at every import without it.
    "${pip_install[@]}" "torch==${TORCH_VERSION}" numpy
fi

"${pip_install[@]}" -e ".[test,lint]"
echo "install.sh: $("$PYTHON" -c 'import torch; print("torch", torch.__version__)'), composable_shard installed (editable)"
