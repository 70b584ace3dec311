#!/usr/bin/env bash
# Two H200s (issue 30): the MoE decoder (preset h200, 1.88B parameters, 8 experts, top-2) with our
# expert_parallel_size=2 beside stock FSDP2 (fully_shard) with a per-expert torch.optim.Muon; step
# time, per-phase bytes and peak memory per rank. Run from the repo root on a machine with 2 GPUs:
#   OUT=<dir> bash scripts/gpu_moe_ep2.sh [flags for gpu_moe_ep2.py, e.g. --steps 8]
# Writes $OUT/gpu_moe_ep2.json (and one file per mode beside it). CPU check: --preset tiny.
OUT=${OUT:-bench_out/moe_ep2}
# shellcheck source=scripts/_gpu_run.sh
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_run.sh"  # env, PYTHONPATH, mkdir OUT, OUT/gpu.txt
timeout 570 python3 scripts/gpu_moe_ep2.py --nproc 2 --out "$OUT" "$@" 2>&1 | grep -v Warning | tail -20
