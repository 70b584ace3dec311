"""The training stall of a checkpoint save: synchronous, ``async_save``, and DCP's ``async_save`` (not CI).

    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 scripts/gpu_async_checkpoint.py --dir /tmp/ckpt --out "$OUT"

Builds the bench model (``--preset onenode`` with ``--layers 8``: 2.41B parameters, bf16, on
CUDA with NCCL; ``--preset tiny`` runs on CPU with gloo as a try-out), shards it with
``matrix_shard`` (Muon on the block matrices, AdamW on the rest), takes a step so every
owner holds optimizer state, then, in one invocation, on the same state:

* ``baseline``: the time of ``--steps`` training steps with no save running;
* ``sync``: ``checkpoint.save_sharded`` (what a save costs today), ``--repeats`` times;
* ``reserve``: ``AsyncCheckpointer.reserve``, what the strategies call after the first optimizer
  step: the host buffer is allocated and pinned in the background while ``--steps`` training
  steps run (each timed), then the time until it is ready (``--no-reserve`` skips this, to see
  the first save allocate it itself);
* ``async``: ``AsyncCheckpointer.save_sharded`` (``async_save=True``), ``--repeats`` times: the
  stall (the call's return; ``stall_first_s`` in the summary is the first save's, which
  allocated the host buffer unless it was reserved), then training steps while the background
  write runs, each timed, and the time until published;
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the same state dicts (a gloo
  group for its background work, as its documentation asks), likewise.

Every timed region starts after a device synchronize. After the last asynchronous save of our
own, whose background write overlapped training, the checkpoint is loaded back and must equal,
bitwise, the weights and optimizer state at the save. Rank 0 writes
``gpu_async_checkpoint.json`` to ``--out``.
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
from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
from lightning_matrixfsdp.runtime.tags import global_numel, is_owned


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _remove(path: Path) -> None:
    """Delete a checkpoint every rank wrote, once: rank 0, after every rank is done with it (the
    directory is shared; each rank deleting it raced on more than one process)."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="scratch directory for the checkpoints")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_async_checkpoint_out"))
    parser.add_argument("--preset", default="onenode")
    parser.add_argument("--layers", type=int, default=8, help="blocks of the preset's model (8: 2.41B)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="baseline steps")
    parser.add_argument("--max-overlap-steps", type=int, default=80)
    parser.add_argument("--no-reserve", action="store_true", help="the first save allocates the host buffer")
    args = parser.parse_args()

    device = resolve_device("auto")  # cuda:LOCAL_RANK where CUDA is, else the CPU
    init_distributed(device, timeout_s=1800)  # NCCL on CUDA, gloo on the CPU; one process without torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    cfg = preset(args.preset)
    if args.layers:
        cfg.model.n_layers = args.layers
    model = preset_decoder(cfg, device)
    mf.matrix_shard(model, matrix_filter=lambda fqn, p: is_matrix(fqn, p, cfg.optim.matrix_scope))
    o = cfg.optim
    opt = mf.Muon(model.parameters(), lr=o.lr, momentum=o.momentum, adamw_lr=o.adamw_lr,
                  adamw_betas=tuple(o.adamw_betas), adamw_eps=o.adamw_eps)
    step_no = [0]

    def step() -> None:
        tokens, targets = make_batch(cfg.model, cfg.run.batch_size, cfg.run.seed, rank, step_no[0], device)
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_no[0] += 1

    step()
    step()
    root = args.dir / "run"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    res: dict[str, Any] = {"baseline_step_s": [_timed(step, device)[0] for _ in range(args.steps)]}

    def overlap(done: Callable[[], bool]) -> tuple[list[float], float]:
        """Steps while ``done()`` is false; their times and the seconds until done."""
        t0, times = time.perf_counter(), []
        while not done() and len(times) < args.max_overlap_steps:
            times.append(_timed(step, device)[0])
        while not done():
            time.sleep(0.01)
        return times, time.perf_counter() - t0

    # synchronous saves
    res["sync_s"] = []
    for i in range(args.repeats):
        path = root / f"sync-{i}"
        res["sync_s"].append(_timed(lambda: C.save_sharded(model, path, [opt]), device)[0])
        res["checkpoint_bytes"] = _dir_bytes(path)
        _remove(path)

    # ours: async_save=True
    saver = AsyncCheckpointer()
    if not args.no_reserve:  # as the strategies do after the first optimizer step
        t0 = time.perf_counter()
        res["reserve_return_s"] = _timed(lambda: saver.reserve(model, [opt]), device)[0]
        res["reserve_overlap_step_s"] = [_timed(step, device)[0] for _ in range(args.steps)]
        res["reserved_bytes"] = saver.staging.nbytes  # waits for the allocation to finish
        res["reserve_ready_after_s"] = time.perf_counter() - t0
    res["async"] = []
    snapshot: dict[str, Any] = {}
    for i in range(args.repeats):
        path = root / f"async-{i}"
        if i == args.repeats - 1:  # what the last save must hold
            snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if is_owned(p) and p.numel()}
            snapshot["opt"] = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                               for p, s in opt.state.items()}
        stall, _ = _timed(lambda: saver.save_sharded(model, path, [opt]), device)
        steps, until = overlap(lambda: not saver.pending)
        saver.wait()
        res["async"].append({"stall_s": stall, "published_after_s": stall + until, "overlap_step_s": steps})
        if i < args.repeats - 1:
            _remove(path)
    res["host_buffer_bytes"] = saver.staging.nbytes
    # the last one: load it back and compare with the state at the save
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in snapshot:
                p.zero_()
    C.load_sharded(model, root / f"async-{args.repeats - 1}", [opt])
    same = all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters() if n in snapshot)
    same = same and all(all(torch.equal(torch.as_tensor(v), torch.as_tensor(snapshot["opt"][id(p)][k]))
                            for k, v in s.items()) for p, s in opt.state.items())
    res["async_loaded_bitwise"] = bool(same)
    _remove(root / f"async-{args.repeats - 1}")
    saver.close()

    # DCP's async_save of the same state dicts
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from lightning_matrixfsdp.checkpoint.index import build_index

    gloo = dist.new_group(backend="gloo")
    res["dcp_async"] = []
    for i in range(args.repeats):
        path = root / f"dcp-{i}"

        def start() -> Any:
            index = build_index(model)
            state = {"state_dict": C.sharded_model_state_dict(model, False, index),
                     "optimizer_0": C.sharded_optimizer_state_dict(model, opt, False, index)}
            return dcp.async_save(state, storage_writer=FileSystemWriter(str(path)), process_group=gloo)

        stall, resp = _timed(start, device)
        fut = getattr(resp, "upload_completion", resp)
        steps, until = overlap(fut.done)
        fut.result()
        res["dcp_async"].append({"stall_s": stall, "published_after_s": stall + until, "overlap_step_s": steps})
        _remove(path)

    base = statistics.median(res["baseline_step_s"])
    summary = {"baseline_step_median_s": base, "sync_median_s": statistics.median(res["sync_s"])}
    for k in ("async", "dcp_async"):
        runs = res[k]
        overl = [s for r in runs for s in r["overlap_step_s"]]
        summary[k] = {"stall_first_s": runs[0]["stall_s"], "stall_later_s": [r["stall_s"] for r in runs[1:]],
                      "published_after_s": [r["published_after_s"] for r in runs],
                      "overlap_steps": len(overl),
                      "overlap_step_median_s": statistics.median(overl) if overl else None,
                      "overlap_slowdown": (statistics.median(overl) / base) if overl else None}
    summary["reserved"] = not args.no_reserve
    summary["reserve_ready_after_s"] = res.get("reserve_ready_after_s")
    summary["first_save_allocated"] = res.get("reserved_bytes") != res["host_buffer_bytes"]
    result = {"preset": args.preset, "layers": cfg.model.n_layers, "world": world, "dtype": cfg.run.dtype,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "parameters": sum(global_numel(p) for p in model.parameters()), "summary": summary, "raw": res,
              "nvls": os.environ.get("NCCL_NVLS_ENABLE")}
    if rank == 0:
        save_json(args.out, "gpu_async_checkpoint.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
