"""Min / median per rank of each phase in load_phases.py's JSON files.

Usage: python summarize_phases.py a.json b.json ...   (columns in that order)
"""

import json
import statistics
import sys

runs = [(path, json.load(open(path))) for path in sys.argv[1:]]


def stats(values):
    return (1e3 * min(values), 1e3 * statistics.median(values)) if values else (float("nan"), float("nan"))


names = []
for _, run in runs:
    for rank in run["ranks"]:
        for sample in rank:
            for name in sample["phases"]:
                if name not in names:
                    names.append(name)

print("ms, min/median over loads; wall | cpu (thread time); calls per load")
print("slowest rank, barrier to barrier:")
for path, run in runs:
    ranks = run["ranks"]
    slowest = [max(r[i]["wall_barrier"] for r in ranks) for i in range(len(ranks[0]))]
    print(f"  {path}: {stats(slowest)[0]:7.1f} / {stats(slowest)[1]:7.1f}  (n={len(slowest)})")
for rank_index in range(len(runs[0][1]["ranks"])):
    print(f"== rank {rank_index}")
    header = "".join(f" | {p[-28:]:>28s}" for p, _ in runs)
    print(f"{'phase':38s}{header}")
    for name in ["(load)", *names]:
        row = f"{name[:38]:38s}"
        for _, run in runs:
            samples = run["ranks"][rank_index]
            if name == "(load)":
                wall, cpu, calls = [s["wall"] for s in samples], [s["cpu"] for s in samples], [1]
            else:
                got = [s["phases"].get(name) for s in samples]
                wall = [g[0] for g in got if g]
                cpu = [g[1] for g in got if g]
                calls = [g[2] for g in got if g]
            if not wall:
                row += f" | {'-':>28s}"
                continue
            (wmin, wmed), (cmin, cmed) = stats(wall), stats(cpu)
            row += f" | {wmin:6.1f}/{wmed:6.1f} {cmin:6.1f}/{cmed:6.1f} x{calls[0]:<3d}"
        print(row)
