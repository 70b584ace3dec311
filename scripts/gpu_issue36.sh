#!/usr/bin/env bash
# One H200 (issue 36): the MoE decoder's forward + backward under matrix_fsdp beside plain
# Lightning (alternating child processes, many steps: one invocation's per-step spread is about
# +-10%), then what QK-Clip costs per step. Run from the repo root: OUT=<dir> bash scripts/gpu_issue36.sh
OUT=${OUT:-bench_out/issue36}
# shellcheck source=scripts/_gpu_run.sh
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_run.sh"  # env, PYTHONPATH, mkdir OUT, OUT/gpu.txt
timeout 400 python3 scripts/gpu_moe_bench.py --out "$OUT/moe" --rounds 2 --steps 40 --warmup 3 --no-experts \
  --part-timeout 190 2>&1 | grep -v Warning | tail -6
timeout 170 python3 scripts/gpu_qkclip.py --out "$OUT/qkclip" --reps 8 2>&1 | tail -15
