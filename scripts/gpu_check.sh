#!/usr/bin/env bash
# The GPU check: every CUDA test of the repository and scripts/bench.py on CUDA
# (bf16, CPU offload, a simulated world size with the overlap report), inside
# 8 minutes in all, then one summary (tests passed / failed, each bench's step
# times and composable_shard / peer ratios). One GPU is enough.
#
# Run from anywhere (it works in the repository root):
#     bash scripts/gpu_check.sh                  # logs and summary.txt in $OUT, else /tmp/gpu_check.<pid>
#     GPU_CHECK_BUDGET_S=300 bash scripts/gpu_check.sh
# Exit status: 0 when every step passed; 1 when a step failed or ran out of
# time; 2 at once, before anything runs, when no CUDA GPU is usable here.
#
# What runs (each step gets at most its cap and whatever is left of the budget):
#   1. pytest on tests/cuda/ and on every test elsewhere marked @requires_cuda or
#      @requires_gpus (found by reading the test files, so a new one is picked up).
#      These are the repository's equivalents of /work/shared/gpu/offload_check.py
#      (offload + bf16 parity step by step against an unsharded reference:
#      tests/cuda/test_cuda_offload.py, test_offload.py, test_offload_fences.py).
#   2. scripts/bench.py --device cuda, world size 1 on NCCL, bf16: all modes
#      (the equivalent of /work/shared/gpu/bench_peers.py at world size 1).
#   3. the same with --cpu-offload (composable_shard, FSDP1, FSDP2).
#   4. --simulate-world-size 8 (PyTorch's fake process group) with --overlap-report.
#
# expecttest: the GPU machines (torch 2.11) do not have it, and some test files
# import it (tests/planning/test_plan.py, tests/handle/test_flat_param.py). Carry
# its wheel: here, in the repository root, once
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 -d .whl expecttest==0.3.0
# then name `.whl` in the device call's carry; this script installs every
# .whl/*.whl into /tmp/site (pip --no-index --target) and puts it on PYTHONPATH.
# Without the wheel and without expecttest, the test files importing it are left
# out (the summary says which) and the rest run.
# The device call itself: run(command="bash scripts/gpu_check.sh", carry=[".whl"],
# timeout_s=540); the logs come back from $OUT. docs/benchmarks.md ("GPU check").

set -u
start=$SECONDS
budget=${GPU_CHECK_BUDGET_S:-480}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2

# No GPU: say so and stop at once (no torch import when there is no NVIDIA device at all).
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU here (no /dev/nvidia* device, no nvidia-smi); nothing was run" >&2
    exit 2
fi
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: torch sees no CUDA GPU here (torch.cuda.is_available() is False); nothing was run" >&2
    exit 2
fi

logs=${OUT:-/tmp/gpu_check.$$}
mkdir -p "$logs"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

left() {  # seconds left of the budget, at most $1
    local rest=$((budget - (SECONDS - start)))
    ((rest > $1)) && rest=$1
    echo $((rest > 0 ? rest : 0))
}
status=0
declare -A rc

# 1. The CUDA tests.
python3 - >"$logs/tests.ids" 2>"$logs/tests.excluded" <<'EOF'
import ast, importlib.util, pathlib, sys
have_expecttest = importlib.util.find_spec("expecttest") is not None
ids = ["tests/cuda"]
for path in sorted(pathlib.Path("tests").rglob("test_*.py")):
    if path.parts[1] == "cuda":
        continue
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | names
    def marked(fn):
        for d in fn.decorator_list:
            d = d.func if isinstance(d, ast.Call) else d
            if isinstance(d, ast.Name) and d.id in ("requires_cuda", "requires_gpus"):
                return True
        return False
    found = [f"{path}::{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef) and marked(n)]
    found += [f"{path}::{c.name}::{n.name}" for c in tree.body if isinstance(c, ast.ClassDef)
              for n in c.body if isinstance(n, ast.FunctionDef) and marked(n)]
    if found and "expecttest" in modules and not have_expecttest:
        print(f"{path} ({len(found)} CUDA tests): imports expecttest, which is not installed (carry its wheel)", file=sys.stderr)
        continue
    ids += found
print("\n".join(ids))
EOF
mapfile -t ids <"$logs/tests.ids"
((${#ids[@]} > 0)) || ids=(tests/cuda)  # never an empty list: pytest would run the whole suite
t=$(left 240)
echo "== CUDA tests: ${#ids[@]} paths/ids, ${t}s"
timeout -k 10 "$t" python3 -m pytest -q -p no:cacheprovider -rfE "${ids[@]}" >"$logs/tests.log" 2>&1
rc[tests]=$?
tail -n 3 "$logs/tests.log"

# 2-4. The benchmark on CUDA (--markdown: tables the summary can read).
bench() {  # name cap args...
    local name=$1 cap=$2
    shift 2
    local t
    t=$(left "$cap")
    echo "== bench $name: ${t}s"
    if ((t < 20)); then
        echo "gpu_check: no time left for bench $name" >"$logs/bench_$name.log"
        rc[$name]=124
        return
    fi
    timeout -k 10 "$t" python3 scripts/bench.py --device cuda --markdown "$@" >"$logs/bench_$name.log" 2>&1
    rc[$name]=$?
}
bench bf16 120 --world-size 1 --mixed-precision bf16 --rounds 2 --steps 4 --warmup 2
bench offload 90 --world-size 1 --mixed-precision bf16 --cpu-offload --modes composable_shard,fsdp1,fsdp2 \
    --rounds 1 --steps 3 --warmup 1
bench simulated 90 --simulate-world-size 8 --mixed-precision bf16 --overlap-report --rounds 1 --steps 3 --warmup 1

# The summary.
{
    echo "GPU check: $(python3 -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__)' 2>/dev/null)"
    echo "elapsed $((SECONDS - start)) s of $budget s"
    counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)" "$logs/tests.log" | tail -n 1)
    echo "tests (exit ${rc[tests]}$( ((rc[tests] == 124 || rc[tests] == 137)) && echo ', timed out')): ${counts:-no pytest summary line, see tests.log}"
    grep -E "^(FAILED|ERROR) " "$logs/tests.log" | head -n 20 | sed 's/^/  /'
    [ -s "$logs/tests.excluded" ] && sed 's/^/  left out: /' "$logs/tests.excluded"
    for name in bf16 offload simulated; do
        echo "bench $name (exit ${rc[$name]}$( ((rc[$name] == 124 || rc[$name] == 137)) && echo ', timed out')):"
        python3 - "$logs/bench_$name.log" <<'EOF'
import re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
header = None
for line in lines:
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    if line.startswith("|") and cells and cells[0] == "mode":
        header = cells
    elif header and line.startswith("|") and not set(cells[0]) <= set("-: "):
        row = dict(zip(header, cells))
        peak = next((v for k, v in row.items() if k.startswith("peak")), "?")
        print(f"  {row['mode']:<17} median {row.get('median ms', '?'):>8} ms  cs/peer {row.get('cs/peer', '?'):>5}"
              f"  peak {peak:>9} MB  loss rel. diff {row.get('rel', '?')}")
    elif not line.startswith("|"):
        header = None
overlap = [i for i, l in enumerate(lines) if l.startswith("overlap of the lanes")]
if overlap:
    print("\n".join("  " + l for l in lines[overlap[0]:overlap[0] + 12] if l.strip()))
if not any(l.startswith("|") for l in lines):
    print("\n".join("  " + l for l in lines[-5:]))
EOF
    done
    echo "logs: $logs"
} | tee "$logs/summary.txt"

for key in "${!rc[@]}"; do
    ((rc[$key] != 0)) && status=1
done
exit $status
