import json, statistics, sys, glob
d = sys.argv[1]
for key in ("load_s", "save_s"):
    for mode in ("composable_shard", "composable_shard_direct"):
        out = {}
        for which in ("before", "main"):
            mins, meds = [], []
            for f in sorted(glob.glob(f"{d}/ck_{which}_*.json")):
                s = json.load(open(f))[0]["samples"][mode][key]
                mins.append(min(s) * 1000); meds.append(statistics.median(s) * 1000)
            out[which] = (statistics.median(mins), min(mins), statistics.median(meds), len(mins), sum(len(json.load(open(f))[0]["samples"][mode][key]) for f in glob.glob(f"{d}/ck_{which}_*.json")))
        b, a = out["before"], out["main"]
        print(f"{key} {mode:24s} median-of-mins {b[0]:.1f} -> {a[0]:.1f} ({100*(a[0]/b[0]-1):+.1f}%)  best {b[1]:.1f} -> {a[1]:.1f} ({100*(a[1]/b[1]-1):+.1f}%)  median-of-medians {b[2]:.1f} -> {a[2]:.1f} ({100*(a[2]/b[2]-1):+.1f}%)  runs {b[3]}/{a[3]} samples {b[4]}/{a[4]}")
