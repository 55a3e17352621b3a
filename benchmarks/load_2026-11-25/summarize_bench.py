"""Min and median of the raw load samples of each bench_checkpoint.py run here (ck_<side>_<k>.json)."""
import json
import statistics
from pathlib import Path

for path in sorted(Path(__file__).parent.glob("ck_*.json"), key=lambda p: (p.stem.split("_")[2], p.stem)):
    for table in json.loads(path.read_text()):
        for mode, samples in table["samples"].items():
            load = samples["load_s"]
            print(f"{path.stem:12s} {mode:24s} load min {1e3 * min(load):7.1f} ms  median {1e3 * statistics.median(load):7.1f} ms  (n={len(load)})")
