"""Checkpoint save and load time with and without checksums, on the bench model (not part of CI).

    torchrun --nproc-per-node 2 scripts/gpu_checkpoint_verify.py --dir /local/scratch/ckpt --out "$OUT"

Builds the one-node bench model (``--preset onenode``: 4.56B parameters, bf16, on CUDA
with NCCL; ``--preset tiny`` or ``small`` run on CPU with gloo for a try-out), shards
it with ``matrix_shard`` (Muon for the block matrices, AdamW for the rest, as the
bench's ``matrix_fsdp`` modes), takes one optimizer step so every owner holds Muon
and AdamW state, then times, ``--repeats`` times each:

* ``save`` with checksums (the default) and without (``checksums=False``): each save
  writes a fresh directory under ``--dir`` (``dcp`` fsyncs every file) that is
  removed after its loads;
* ``load`` of the checksummed directory with verification (the default) and without
  (``verify=False``);
* the checksum work alone: recording (``file_records``) and verifying
  (``verify_files``) the checksums of a saved directory.

Times are the slowest rank's, in seconds, with a warm page cache (nothing drops it);
the two saves and the two loads of a repeat swap order from one repeat to the next,
so neither always comes first. Every load is checked: the parameters are zeroed
before it and must come back bitwise. Rank 0 writes ``gpu_checkpoint_verify.json``
to ``--out``. About 4.5 minutes on 2 x H200 with ``--repeats 3``, 3.5 with ``--repeats 2``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import lightning_matrixfsdp as mf
from lightning_matrixfsdp import checkpoint as C
from lightning_matrixfsdp.bench.config import preset
from lightning_matrixfsdp.bench.launch import init_distributed, resolve_device
from lightning_matrixfsdp.bench.model import is_matrix, make_batch
from lightning_matrixfsdp.bench.modes import preset_decoder
from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.checkpoint.integrity import checksum_threads, file_records, verify_files
from lightning_matrixfsdp.runtime.tags import global_numel, is_owned


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn`` on the slowest rank."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                     device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="scratch directory for the checkpoints")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_checkpoint_verify_out"),
                        help="where the JSON goes (default: $OUT)")
    parser.add_argument("--preset", default="onenode", help="bench model preset: onenode (GPU), small, tiny")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = resolve_device("auto")  # cuda:LOCAL_RANK where CUDA is, else the CPU
    init_distributed(device, timeout_s=1800)  # NCCL on CUDA, gloo on the CPU; one process without torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    cfg = preset(args.preset)
    root = args.dir / f"run-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"

    model = preset_decoder(cfg, device)
    scope = cfg.optim.matrix_scope
    mf.matrix_shard(model, matrix_filter=lambda fqn, p: is_matrix(fqn, p, scope))
    o = cfg.optim
    opt = mf.Muon(model.parameters(), lr=o.lr, momentum=o.momentum, adamw_lr=o.adamw_lr,
                  adamw_betas=tuple(o.adamw_betas), adamw_eps=o.adamw_eps)
    tokens, targets = make_batch(cfg.model, cfg.run.batch_size, cfg.run.seed, rank, 0, device)
    t_step = _timed(lambda: (model(tokens, targets).backward(), opt.step(), opt.zero_grad(set_to_none=True)), device)
    owned = {n: p.detach().clone() for n, p in model.named_parameters() if is_owned(p) and p.numel()}

    def check_loaded() -> None:
        bad = [n for n, p in model.named_parameters() if n in owned and not torch.equal(p, owned[n])]
        if bad:
            raise AssertionError(f"rank {rank}: load did not restore {bad[:5]}")

    def load(path: Path, verify: bool) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in owned:
                    p.zero_()
        C.load_sharded(model, path, [opt], verify=verify)

    def clean(path: Path) -> None:
        if rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()

    times: dict[str, list[float]] = {k: [] for k in ("save_checksums", "save_no_checksums", "load_verify",
                                                     "load_no_verify", "record_checksums_only",
                                                     "verify_checksums_only")}
    size = 0
    for i in range(args.repeats):
        a, b = root / f"with-{i}", root / f"without-{i}"
        clean(a)
        clean(b)
        saves = [("save_checksums", a, True), ("save_no_checksums", b, False)]
        for key, path, checksums in saves[:: 1 if i % 2 == 0 else -1]:
            times[key].append(_timed(lambda: C.save_sharded(model, path, [opt], checksums=checksums), device))
        size = _dir_bytes(a)
        loads = [("load_verify", True), ("load_no_verify", False)]
        for key, verify in loads[:: 1 if i % 2 == 0 else -1]:
            times[key].append(_timed(lambda: load(a, verify), device))
            check_loaded()
        records = C.read_sidecar(a)["files"]
        names = sorted(records)
        times["record_checksums_only"].append(_timed(lambda: file_records(a, names, True), device))
        times["verify_checksums_only"].append(_timed(lambda: verify_files(a, records, True), device))
        clean(a)
        clean(b)
    clean(root)

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "preset": args.preset, "world": world, "dtype": cfg.run.dtype,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "parameters": sum(global_numel(p) for p in model.parameters()),
        "checkpoint_bytes": size, "repeats": args.repeats, "step_s": t_step,
        "times_s": times, "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
        "save_overhead_pct": 100 * (med["save_checksums"] / med["save_no_checksums"] - 1),
        "load_overhead_pct": 100 * (med["load_verify"] / med["load_no_verify"] - 1),
        "checksum_GBps_per_rank": size / world / med["record_checksums_only"] / 1e9,
        "verify_GBps_per_rank": size / world / med["verify_checksums_only"] / 1e9,
        "threads_per_rank": checksum_threads(),
    }
    if rank == 0:
        save_json(args.out, "gpu_checkpoint_verify.json", result, omit=("times_s",))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
