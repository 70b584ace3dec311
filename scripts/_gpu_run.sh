# Shared start of the one-command GPU runs (gpu_moe_bench.sh, gpu_moe_ep2.sh); sourced, not run.
# The caller sets OUT's default first (OUT=${OUT:-...}). NVLink multicast off, as in every GPU
# script; $OUT made; the repository on PYTHONPATH; the machine (GPUs, driver, torch, lightning,
# CUDA) written to $OUT/gpu.txt, beside the results it explains.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"
