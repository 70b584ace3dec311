#!/usr/bin/env bash
# The GPU batch behind docs/benchmarks.md: run on 2 x H200 (device tool) from the repo root.
#   OUT=<dir> BENCH_GIT_REVISION=<rev> bash scripts/bench_h200.sh [quick|check|tune|replica|full]
# Carried wheels in .whl/ (muon-fsdp2) are installed to /tmp/site when present.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"
N=$(nvidia-smi -L | wc -l)
case "${1:-full}" in
  quick)
    torchrun --nproc-per-node "$N" -m lightning_matrixfsdp.bench --preset small --modes matrix_fsdp ddp_muon fsdp2_muon \
      --out "$OUT/quick" --no-plot --timeout 120 2>&1 | tail -25 ;;
  tune)
    timeout 500 python3 scripts/tune_owner_step.py "$OUT" ${2:-momentum,blocks,trace,step} 2>&1 | tail -80 ;;
  check)
    # The restructure check: default p2p against stock FSDP2 + Muon in one invocation, short.
    # (The checkpoint checksum cost: scripts/gpu_checkpoint_verify.py, see its docstring.)
    timeout 200 torchrun --nproc-per-node "$N" -m lightning_matrixfsdp.bench --preset onenode \
      --modes matrix_fsdp_p2p fsdp2_muon --warmup 2 --steps 6 --out "$OUT/bench" --timeout 120 --no-plot 2>&1 \
      | grep -v Warning | tail -12 ;;
  replica)
    # replica_split (issue 13): HSDP with shard_size=1 on the GPUs (R=N replicas, W=1), unsplit and
    # split, next to DDP Muon, in one invocation; 3 + 17 = 20 bf16 steps, every step's loss recorded.
    timeout 560 torchrun --nproc-per-node "$N" -m lightning_matrixfsdp.bench --preset onenode \
      --modes ddp_muon matrix_hsdp matrix_hsdp_split --warmup 3 --steps 17 --out "$OUT/replica" --timeout 120 \
      --no-plot 2>&1 | grep -v Warning | tail -16 ;;
  full)
    timeout 200 python3 -m lightning_matrixfsdp.bench.orthogonalizers --out "$OUT" 2>&1 | tail -20
    timeout 240 python3 scripts/profile_owner_step.py "$OUT" > "$OUT/profile.log" 2>&1
    torchrun --nproc-per-node "$N" -m lightning_matrixfsdp.bench --preset onenode --modes all --out "$OUT" \
      --timeout 120 --no-plot 2>&1 | grep -v Warning | tail -40 ;;
esac
