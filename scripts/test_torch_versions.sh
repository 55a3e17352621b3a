#!/usr/bin/env bash
# Runs the test suite on each given torch release, each in a throwaway virtual
# environment of its own, and prints one line of results per version.
#
# Usage (from anywhere):
#   bash scripts/test_torch_versions.sh [--dir DIR] [--wheels DIR] [--keep] VERSION...
#   e.g. bash scripts/test_torch_versions.sh 2.6.0 2.11.0 2.15.0
#
#   --dir DIR     where the environments and logs go (default /tmp/composable_shard_torch_versions);
#                 DIR/torch-VERSION is removed and made again for each run.
#   --wheels DIR  a folder of wheels to install from first (e.g. filled beforehand with
#                 `pip download -d DIR torch==VERSION`): old torch releases are CUDA builds
#                 of several GB each; they run on CPU.
#   --keep        keep the environments afterwards (default: removed once the suite ran).
#   --reuse       use DIR/torch-VERSION as it is when its torch is VERSION (made by --keep, or by
#                 hand with the pins below), instead of making it again.
#   PYTHON=...    the interpreter the environments are made from (default python3).
#   PYTEST_ARGS   extra pytest arguments (e.g. "-x" or "tests/plan/test_plan.py").
#
# Versions are exact (2.6.0, not 2.6). The test extra (pyproject.toml, lightning and
# heavyball pinned there as here) is pinned to releases that
# work with each torch: transformers >= 5 needs torch >= 2.6, so older torch gets
# transformers 4.46.3 / peft 0.13.2 (and numpy < 2, as those releases were built for).
# The suite runs against this checkout (PYTHONPATH), never an installed copy.
# Exit status: 0 when every version passed, 1 otherwise.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DIR="/tmp/composable_shard_torch_versions"
WHEELS=""
KEEP=0
REUSE=0
VERSIONS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --keep) KEEP=1; shift ;;
        --reuse) REUSE=1; shift ;;
        -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "test_torch_versions.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) VERSIONS+=("$1"); shift ;;
    esac
done
if [[ ${#VERSIONS[@]} -eq 0 ]]; then
    echo "test_torch_versions.sh: give at least one exact torch version, e.g. 2.6.0 2.11.0 (see --help)" >&2
    exit 2
fi
for version in "${VERSIONS[@]}"; do
    if [[ ! "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        echo "test_torch_versions.sh: '$version' is not an exact release (MAJOR.MINOR.PATCH, e.g. 2.6.0)" >&2
        exit 2
    fi
done
mkdir -p "$DIR"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pip_args=(--quiet)
[[ -n "$WHEELS" ]] && pip_args+=(--find-links "$WHEELS")

# The packages of the test extra (pyproject.toml) pinned for one torch version.
extra_for() {
    local minor
    minor="$(echo "$1" | cut -d. -f2)"
    if [[ "$(echo "$1" | cut -d. -f1)" -eq 2 && "$minor" -lt 6 ]]; then
        echo "numpy<2 transformers==4.46.3 peft==0.13.2"
    else
        echo "numpy transformers peft"
    fi
}

status=0
results=()
for version in "${VERSIONS[@]}"; do
    env_dir="$DIR/torch-$version"
    log="$DIR/torch-$version.log"
    start=$(date +%s)
    if [[ $REUSE -eq 1 ]] && [[ "$("$env_dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" == "$version" ]]; then
        echo "test_torch_versions.sh: torch $version: reusing $env_dir (log: $log)"
        : >"$log"
    else
        rm -rf "$env_dir"
        echo "test_torch_versions.sh: torch $version: making $env_dir (log: $log)"
        # shellcheck disable=SC2046  # extra_for's words are separate requirements
        if ! { "$PYTHON" -m venv "$env_dir" \
               && "$env_dir/bin/python" -m pip install "${pip_args[@]}" "torch==$version" $(extra_for "$version") \
                    pytest expecttest safetensors xxhash matplotlib lightning==2.6.0 heavyball==3.2.1; } >"$log" 2>&1; then
            results+=("torch $version: INSTALL FAILED (see $log)")
            status=1
            continue
        fi
    fi
    installed="$("$env_dir/bin/python" -c 'import torch, transformers, peft; print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")' 2>>"$log")"
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$env_dir/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests}) >>"$log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - start ))
    summary="$(grep -E '^=*.*( passed| failed| error).* in [0-9.]+s' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
    [[ $rc -eq 0 ]] && verdict="green" || { verdict="RED (pytest exit $rc)"; status=1; }
    results+=("torch $version: $verdict: ${summary:-no pytest summary} ($installed; ${seconds}s in all; log $log)")
    [[ $KEEP -eq 1 ]] || rm -rf "$env_dir"
done

echo
printf '%s\n' "${results[@]}"
exit $status
