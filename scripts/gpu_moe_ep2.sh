#!/usr/bin/env bash
# Two H200s (issue 30): the MoE decoder (preset h200, 1.88B parameters, 8 experts, top-2) with our
# expert_parallel_size=2 beside stock FSDP2 (fully_shard) with a per-expert torch.optim.Muon; step
# time, per-phase bytes and peak memory per rank. Run from the repo root on a machine with 2 GPUs:
#   OUT=<dir> bash scripts/gpu_moe_ep2.sh [flags for gpu_moe_ep2.py, e.g. --steps 8]
# Writes $OUT/gpu_moe_ep2.json (and one file per mode beside it). CPU check: --preset tiny.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out/moe_ep2}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"
timeout 570 python3 scripts/gpu_moe_ep2.py --nproc 2 --out "$OUT" "$@" 2>&1 | grep -v Warning | tail -20
