#!/usr/bin/env bash
# One H200 (issue 37): the rooms restructure against the landing before it, side by side in one
# device call, alternating revisions so drift of the machine hits both alike.
#   git archive <base> lightning_matrixfsdp scripts | tar -x -C build/rev_base
#   OUT=<dir> BASE=$PWD/build/rev_base bash scripts/gpu_issue37.sh dense|moe [ROUNDS]
# dense: compare_revisions.sh (the one-node decoder cut to 8 layers, default mode, per phase);
# moe:   the MoE decoder's `train ours` part of gpu_moe_bench.py, each revision with its own
#        script and package, medians of fwd+bwd and optimizer step; writes $OUT/moe/compare.json.
set -u
WHAT=${1:?dense or moe}
ROUNDS=${2:-3}
OUT=${OUT:-bench_out/issue37}
BASE=${BASE:?BASE=<absolute directory holding the older lightning_matrixfsdp and scripts>}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ "$WHAT" = dense ]; then
  OUT=$OUT/dense bash scripts/compare_revisions.sh "$ROUNDS" --preset onenode --layers 8 --warmup 2 --steps 6 \
    --timeout 120
  exit
fi
NEW=$PWD
mkdir -p "$OUT/moe"
for i in $(seq 1 "$ROUNDS"); do
  for rev in base new; do
    if [ "$rev" = base ]; then root=$BASE; else root=$NEW; fi
    (cd "$root" && PYTHONPATH=$root timeout 200 python3 scripts/gpu_moe_bench.py --preset "${PRESET:-h200}" --steps "${STEPS:-30}" --warmup 3 \
      --part train ours --json "$OUT/moe/$rev-$i.json" 2>&1 | grep -v Warning | tail -2)
  done
done
python3 - "$OUT/moe" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
keys = ("fwd_bwd_ms", "opt_ms", "total_ms")
runs = {rev: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{rev}-*.json"))] for rev in ("base", "new")}
result = {"rounds": {k: len(v) for k, v in runs.items()}}
if all(runs.values()):
    med = {rev: {k: statistics.median(r[k] for r in rs) for k in keys} for rev, rs in runs.items()}
    result["median_ms"] = med
    result["per_round_ms"] = {rev: [{k: round(r[k], 2) for k in keys} for r in rs] for rev, rs in runs.items()}
    result["ratio_new_over_base"] = {k: med["new"][k] / med["base"][k] for k in keys}
    result["peak_gib"] = {rev: max(r["peak_gib"] or 0 for r in rs) for rev, rs in runs.items()}
json.dump(result, open(f"{out}/compare.json", "w"), indent=1)
print(json.dumps(result, indent=1))
PY
