# Shared preamble of the revision-comparison scripts (compare_revisions.sh, single_device.sh);
# sourced, not run. The caller sets OUT's default first (OUT=${OUT:-...}) and sources this
# file WITHOUT arguments, so that the shift below consumes the caller's own ROUNDS argument.
# NVLink multicast off, as in the other GPU scripts (bench_h200.sh, convergence_h200.sh).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BASE=${BASE:?BASE=<directory holding the older lightning_matrixfsdp>}
ROUNDS=${1:-2}
shift || true
mkdir -p "$OUT"
