#!/usr/bin/env bash
# One device: Lightning's default, matrix_fsdp at an older revision (BASE) and now, alternating.
#   OUT=<dir> BASE=build/rev_base bash scripts/single_device.sh [ROUNDS] [flags for single_device.py]
OUT=${OUT:-bench_out/single}
# shellcheck source=scripts/_gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"  # env, BASE, ROUNDS (shifted off), mkdir OUT
for i in $(seq 1 "$ROUNDS"); do
  PYTHONPATH=$PWD timeout 250 python3 scripts/single_device.py auto "$OUT/auto-$i.json" "$@" 2>&1 | tail -1
  PYTHONPATH=$BASE timeout 250 python3 scripts/single_device.py matrix_fsdp "$OUT/base-$i.json" "$@" 2>&1 | tail -1
  PYTHONPATH=$PWD timeout 250 python3 scripts/single_device.py matrix_fsdp "$OUT/new-$i.json" "$@" 2>&1 | tail -1
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
runs = {k: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{k}-*.json"))] for k in ("auto", "base", "new")}
res = {k: {"median_ms": statistics.median(r["median_ms"] for r in v), "peak_gib": max(r["peak_gib"] for r in v),
           "runs_ms": [r["median_ms"] for r in v]} for k, v in runs.items() if v}
for k in ("base", "new"):
    if k in res and "auto" in res:
        res[k]["time_vs_auto"] = res[k]["median_ms"] / res["auto"]["median_ms"]
        res[k]["peak_vs_auto"] = res[k]["peak_gib"] / res["auto"]["peak_gib"]
json.dump(res, open(f"{out}/single_device.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
