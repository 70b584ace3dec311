#!/usr/bin/env bash
# Two revisions of the package side by side in one invocation: the restructure check.
#   git archive <rev> lightning_matrixfsdp | tar -x -C build/rev_base   # the older revision
#   OUT=<dir> BASE=build/rev_base bash scripts/compare_revisions.sh [ROUNDS] [extra bench flags...]
# Runs the benchmark's default matrix_fsdp mode ROUNDS times for each revision, alternating
# (base, new, base, new, ...) so drift of the machine hits both alike, then writes
# $OUT/compare.json: per-phase medians of each revision and new/base ratios.
OUT=${OUT:-bench_out/compare}
# shellcheck source=scripts/_gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"  # env, BASE, ROUNDS (shifted off), mkdir OUT
if command -v nvidia-smi >/dev/null 2>&1; then N=$(nvidia-smi -L | wc -l); DEVICE=cuda; else N=2; DEVICE=cpu; fi
for i in $(seq 1 "$ROUNDS"); do
  for rev in base new; do
    if [ "$rev" = base ]; then root=$BASE; else root=$PWD; fi
    PYTHONPATH=$root timeout 280 torchrun --nproc-per-node "$N" -m lightning_matrixfsdp.bench --device "$DEVICE" \
      --modes matrix_fsdp_p2p --out "$OUT/$rev-$i" --no-plot "$@" 2>&1 | grep -v Warning | tail -3
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
phases = ("forward", "backward", "optimizer_step", "total")
runs = {"base": [], "new": []}
for rev in runs:
    for f in sorted(glob.glob(f"{out}/{rev}-*/*.json")):
        mode = json.load(open(f))["modes"]["matrix_fsdp_p2p"]
        if mode["status"] == "ok":
            runs[rev].append(mode)
result = {"rounds": {k: len(v) for k, v in runs.items()}}
if all(runs.values()):
    med = {rev: {p: statistics.median(m["time_ms"][p] for m in ms) for p in phases} for rev, ms in runs.items()}
    result["median_ms"] = med
    result["ratio_new_over_base"] = {p: med["new"][p] / med["base"][p] for p in phases}
    result["losses_equal"] = all(m["losses"] == runs["base"][0]["losses"] for m in runs["base"] + runs["new"])
    # On a GPU the base's own runs may already differ (non-deterministic kernels): then
    # losses_equal says nothing about the change; compare bitwise on CPU instead.
    result["base_runs_agree"] = all(m["losses"] == runs["base"][0]["losses"] for m in runs["base"])
    result["bytes_equal"] = all(m["bytes"] == runs["base"][0]["bytes"] for m in runs["base"] + runs["new"])
json.dump(result, open(f"{out}/compare.json", "w"), indent=1)
print(json.dumps(result, indent=1))
PY
