#!/usr/bin/env bash
# One H200 (issue 30): the MoE decoder through the Trainer, matrix_fsdp with the package's Muon
# beside plain Lightning with a per-expert torch.optim.Muon, and the experts' step against its
# Newton-Schulz FLOP floor. Run from the repo root:
#   OUT=<dir> bash scripts/gpu_moe_bench.sh [flags for gpu_moe_bench.py, e.g. --rounds 2]
# Writes $OUT/gpu_moe_bench.json and the parts' JSON beside it; about 2-3 minutes on an H200.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out/moe}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"
timeout 560 python3 scripts/gpu_moe_bench.py --out "$OUT" "$@" 2>&1 | grep -v Warning | tail -20
