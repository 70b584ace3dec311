#!/usr/bin/env bash
# One H200 (issue 30): the MoE decoder through the Trainer, matrix_fsdp with the package's Muon
# beside plain Lightning with a per-expert torch.optim.Muon, and the experts' step against its
# Newton-Schulz FLOP floor. Run from the repo root:
#   OUT=<dir> bash scripts/gpu_moe_bench.sh [flags for gpu_moe_bench.py, e.g. --rounds 2]
# Writes $OUT/gpu_moe_bench.json and the parts' JSON beside it; about 2-3 minutes on an H200.
OUT=${OUT:-bench_out/moe}
# shellcheck source=scripts/_gpu_run.sh
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_run.sh"  # env, PYTHONPATH, mkdir OUT, OUT/gpu.txt
timeout 560 python3 scripts/gpu_moe_bench.py --out "$OUT" "$@" 2>&1 | grep -v Warning | tail -20
