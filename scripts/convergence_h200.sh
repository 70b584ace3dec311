#!/usr/bin/env bash
# Issue 15: does Muon(orthogonalizer="fast") train as well as the default? One device command on 2 x H200:
#   bash scripts/convergence_h200.sh [extra args for python -m lightning_matrixfsdp.bench.convergence]
# Grid: newton_schulz, fast, polar_express, gram_polar_express x lr 0.00125, 0.000625 (the default's best on
# this model, and half of it) x seeds 0-2 (24 runs of 1000 steps), plus the default at lr 0.0025 (seed 0); the
# demo GPT at d_model 1024, 6 layers (77 M parameters), seq 512, batch 16, byte-level on pydoc topics + stdlib
# sources. Single-GPU runs, 3 at a time per GPU; first the optimizer-step timing pass on GPU 0 while GPU 1
# trains (the clean speed figure: --timing-only --timing-rounds 5, nothing else on the machine).
# The tables in docs/benchmarks.md "Convergence" came from several such commands (arguments there).
# About 75 s per run with 6 at once, so ~5-6 min; --deadline-s stops starting runs that would end past 480 s, so
# the command ends before 9 min. Results go to bench_out/convergence (git-ignored, so kept on a warm machine:
# running the script again finishes the grid, --skip-done) and are copied to $OUT/convergence:
# runs/*.json, timing.json, convergence.md, convergence.png, summary.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
RES=${CONVERGENCE_DIR:-bench_out/convergence}
mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RES/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
  >> "$RES/gpu.txt" 2>&1
git rev-parse HEAD >> "$RES/gpu.txt" 2>/dev/null
timeout 530 python3 -m lightning_matrixfsdp.bench.convergence --out "$RES" --device cuda --gpus 0,1 \
  --procs-per-device 3 --deadline-s 480 --skip-done "$@" 2>&1 | grep -v Warning | tail -60
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/convergence" && cp -r "$RES"/. "$OUT/convergence/"
fi
