"""Run every selected mode in one process group and collect comparable figures.

Per mode: build (fresh seeded model), `warmup + steps` timed steps with a device
synchronize at each phase boundary and a barrier before each step, then one
extra step with the byte counter on (so counting never perturbs the timings).
Each rank measures locally; the ranks' results meet once per mode through
`all_gather_object` on a separate gloo control group, so one rank failing
mid-mode turns into a "failed" entry (after the collective timeout at worst)
instead of a crash of the whole run. All modes share the default process group
(fresh groups per mode confused DTensor's caches, which key meshes by ranks).
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_matrixfsdp.runtime.consensus import CHECK_ENV
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops

from .comm import CommCounter
from .config import BenchConfig
from .launch import control_group, init_distributed, resolve_device
from .model import count_parameters, is_matrix, make_batch, unit_of
from .modes import BUILDERS, ModeContext, ModeUnavailable, TrainStep
from .report import write_outputs
from .timing import PHASES, MemoryProbe, PhaseTimer, matmul_tflops, median_rows, synchronize

COUNT_PHASES: tuple[str, ...] = PHASES


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(step: TrainStep) -> dict[str, int]:
    """What this rank keeps between steps: parameters, gradients, optimizer state."""
    params = list(step.model.parameters())
    out = {"params": sum(_nbytes(p) for p in params), "grads": sum(_nbytes(p.grad) for p in params), "optimizer": 0}
    for opt in step.optimizers:
        for st in getattr(opt, "state", {}).values():
            for v in st.values() if isinstance(st, dict) else ():
                if isinstance(v, torch.Tensor):
                    out["optimizer"] += _nbytes(v)
    return out


def ownership(step: TrainStep, ctx: ModeContext) -> dict[str, Any]:
    """Per-unit resident parameter bytes and Newton-Schulz FLOPs this rank is responsible for."""
    scope, ns = ctx.cfg.optim.matrix_scope, ctx.cfg.optim.ns_steps
    me = ctx.group.rank()
    units: dict[str, int] = {}
    flops = 0
    for name, p in step.raw.named_parameters():
        name = name.removeprefix("module.")
        local = _local(p)
        if step.owners is not None:  # replicated params with owners (ZeRO-1)
            owned = step.owners.get(name) == me
            size = local.numel() * local.element_size() if owned else 0
            if owned and is_matrix(name, p, scope):
                flops += newton_schulz_flops(p.shape, ns)
        else:
            size = local.numel() * local.element_size()
            # A whole, non-empty local matrix is one this rank orthogonalizes alone (unless
            # another replica steps it: replica_split).
            if (local.ndim == 2 and local.numel() > 0 and tuple(local.shape) == tuple(p.shape)
                    and is_matrix(name, p, scope) and (step.stepped is None or name in step.stepped)):
                flops += newton_schulz_flops(p.shape, ns)
        units[unit_of(name)] = units.get(unit_of(name), 0) + size
    return {"unit_bytes": units, "ns_flops": flops}


def measure(step: TrainStep, ctx: ModeContext) -> dict[str, Any]:
    """Timed steps, then one counted step; everything local to this rank."""
    cfg, device = ctx.cfg, ctx.device
    rank = dist.get_rank()
    probe = MemoryProbe(device)
    timer = PhaseTimer(device, probe)
    rows: list[list[float]] = []
    losses: list[torch.Tensor] = []
    n = cfg.run.warmup + cfg.run.steps
    probe.start()
    for i in range(n):
        tokens, targets = make_batch(cfg.model, cfg.run.batch_size, cfg.run.seed, rank, i, device)
        synchronize(device)
        dist.barrier(group=ctx.group)
        timer.start()
        step.zero_grad()
        timer.mark("zero_grad")
        loss = step.forward(tokens, targets)
        timer.mark("forward")
        step.backward(loss)
        timer.mark("backward")
        step.optimizer_step()
        timer.mark("optimizer_step")
        rows.append(timer.row())
        losses.append(loss.detach().float())
    out: dict[str, Any] = {
        "rows": rows,
        "losses": [float(x) for x in torch.stack(losses).cpu()],
        "peak_memory": probe.peak(),
        "memory_kind": probe.kind,
        "state_bytes": state_bytes(step),
        "ownership": ownership(step, ctx),
    }
    if cfg.run.count_bytes:
        out.update(count_step(step, ctx, n))
    return out


def count_step(step: TrainStep, ctx: ModeContext, index: int) -> dict[str, Any]:
    """One extra step under the byte counter, phase by phase (+ the runtime's own counters)."""
    cfg, device = ctx.cfg, ctx.device
    tokens, targets = make_batch(cfg.model, cfg.run.batch_size, cfg.run.seed, dist.get_rank(), index, device)
    if step.comm_stats_fn is not None:
        step.comm_stats_fn(True)
    synchronize(device)
    dist.barrier(group=ctx.group)
    # Compiled regions (muon-fsdp2 compiles its Newton-Schulz) run eagerly under the counter:
    # torch.compile refuses a non-infra dispatch mode, and eager execution shows every op.
    with torch.compiler.set_stance("force_eager"), CommCounter([ctx.group]) as counter:
        counter.phase = "zero_grad"
        step.zero_grad()
        counter.phase = "forward"
        loss = step.forward(tokens, targets)
        counter.phase = "backward"
        step.backward(loss)
        counter.phase = "optimizer_step"
        step.optimizer_step()
        synchronize(device)
    out: dict[str, Any] = {"bytes": counter.totals()}
    if step.comm_stats_fn is not None:
        try:
            out["runtime_bytes"] = _plain(step.comm_stats_fn(False))
        except Exception as exc:
            out["runtime_bytes_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _plain(obj: Any) -> Any:
    """JSON-safe copy (tensors -> numbers, unknown objects -> str)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def combine(name: str, per_rank: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Merge the ranks' local results into the mode's report entry (on rank 0)."""
    statuses = [r["status"] for r in per_rank]
    bad = [(i, r) for i, r in enumerate(per_rank) if r["status"] != "ok"]
    if bad:
        status = next((r["status"] for _, r in bad if r["status"] == "failed"), bad[0][1]["status"])
        entry: dict[str, Any] = {"status": status, "error": bad[0][1].get("error"), "errors_by_rank": {i: r.get("error") for i, r in bad}}
        tb = next((r.get("traceback") for _, r in bad if r.get("traceback")), None)
        if tb:
            entry["traceback"] = tb
        return entry
    assert all(s == "ok" for s in statuses)
    warm = cfg.run.warmup
    steps = len(per_rank[0]["rows"])
    max_rows = [[max(r["rows"][s][c] for r in per_rank) for c in range(len(PHASES) + 1)] for s in range(steps)]
    med = median_rows(max_rows[warm:])
    keys = list(PHASES) + ["total"]
    losses = [statistics.fmean(r["losses"][s] for r in per_rank) for s in range(steps)]
    entry = {
        "status": "ok",
        "time_ms": dict(zip(keys, med)),
        "time_ms_per_step": [dict(zip(keys, row)) for row in max_rows],
        "losses": losses,
        "memory": {
            "kind": per_rank[0]["memory_kind"],
            "per_rank_bytes": [r["peak_memory"] for r in per_rank],
            "max_bytes": max((r["peak_memory"] or 0) for r in per_rank) or None,
        },
        "state_bytes": {k: [r["state_bytes"][k] for r in per_rank] for k in per_rank[0]["state_bytes"]},
        "balance": balance([r["ownership"] for r in per_rank]),
        "info": per_rank[0].get("info", {}),
    }
    if "bytes" in per_rank[0]:
        entry["bytes"] = merge_bytes([r["bytes"] for r in per_rank])
    if "runtime_bytes" in per_rank[0]:
        entry["runtime_bytes"] = [r.get("runtime_bytes") for r in per_rank]
    if "runtime_bytes_error" in per_rank[0]:
        entry["runtime_bytes_error"] = per_rank[0]["runtime_bytes_error"]
    return entry


def merge_bytes(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """{phase: {sent: [per rank], recv: [...], calls: [...], max_sent, max_recv, ops: rank-0 breakdown}}."""
    out: dict[str, Any] = {}
    for phase in COUNT_PHASES:
        rs = [r.get(phase, {"sent": 0, "recv": 0, "calls": 0, "ops": {}}) for r in per_rank]
        out[phase] = {
            "sent": [x["sent"] for x in rs],
            "recv": [x["recv"] for x in rs],
            "calls": [x["calls"] for x in rs],
            "max_sent": max(x["sent"] for x in rs),
            "max_recv": max(x["recv"] for x in rs),
            "ops_rank0": rs[0]["ops"],
        }
    return out


def balance(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """max/avg imbalance of resident bytes and NS FLOPs, and gamma per unit."""
    world = len(per_rank)
    units = sorted({u for r in per_rank for u in r["unit_bytes"]}, key=_unit_key)
    totals = [sum(r["unit_bytes"].values()) for r in per_rank]
    flops = [r["ns_flops"] for r in per_rank]

    def ratio(xs: list[int]) -> float | None:
        avg = sum(xs) / len(xs)
        return max(xs) / avg if avg > 0 else None

    gamma = {}
    for u in units:
        loads = [r["unit_bytes"].get(u, 0) for r in per_rank]
        total = sum(loads)
        gamma[u] = max(loads) / (total / world) if total > 0 else None
    return {
        "resident_param_bytes": totals,
        "param_bytes_max_over_avg": ratio(totals),
        "ns_flops": flops,
        "ns_flops_max_over_avg": ratio(flops),
        "gamma": gamma,
        "gamma_max": max((g for g in gamma.values() if g is not None), default=None),
        "unit_bytes": {u: [r["unit_bytes"].get(u, 0) for r in per_rank] for u in units},
    }


def _unit_key(u: str) -> tuple[int, int]:
    return (1, int(u.split(".")[1])) if u.startswith("blocks.") else (0, 0)


def run_mode(name: str, cfg: BenchConfig, device: torch.device, ctrl: dist.ProcessGroup) -> dict[str, Any] | None:
    """Build, measure and tear down one mode; returns the combined entry on rank 0."""
    group = dist.group.WORLD
    assert group is not None
    mesh = DeviceMesh.from_group(group, device.type)
    ctx = ModeContext(cfg, device, group, mesh)
    local: dict[str, Any]
    step: TrainStep | None = None
    try:
        step = BUILDERS[name](ctx)
        local = {"status": "ok", **measure(step, ctx), "info": _plain(step.info)}
    except ModeUnavailable as exc:
        local = {"status": exc.status, "error": str(exc)}
    except Exception as exc:  # recorded, not raised: other modes still run
        local = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))[-4000:],
        }
        print(f"[bench rank {dist.get_rank()}] {name} failed: {local['error']}", file=sys.stderr, flush=True)
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local, group=ctrl)
    if dist.get_rank() != 0:
        return None
    return combine(name, gathered, cfg)


def _git_revision() -> str | None:
    """$BENCH_GIT_REVISION if set (machines without .git), else read from .git files (no git command)."""
    if os.environ.get("BENCH_GIT_REVISION"):
        return os.environ["BENCH_GIT_REVISION"]
    root = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (root / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (root / ref).exists():
            return (root / ref).read_text().strip()
        for line in (root / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        return None
    return None


def metadata(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    import lightning_matrixfsdp

    meta: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": str(device.type),
        "torch": torch.__version__,
        "lightning_matrixfsdp": getattr(lightning_matrixfsdp, "__version__", None),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "git_revision": _git_revision(),
        "parameters": count_parameters(cfg.model),
        "dtype": cfg.run.dtype,
    }
    if device.type == "cuda":
        # The ceiling behind the Newton-Schulz FLOP floor, measured in this invocation.
        meta["matmul_bf16_tflops"] = matmul_tflops(device)
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
        try:
            meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    return meta


def run_benchmark(cfg: BenchConfig) -> dict[str, Any] | None:
    """Entry point for every rank; rank 0 returns (and writes) the results."""
    # The bench measures the data path: the runtime's rank-divergence check (on by default
    # on gloo) would add its own small all-gathers to the counted bytes and to the step
    # time. Set the variable to 1 to measure a run with it. Restored afterwards: the caller
    # (a test process, a notebook) keeps its own setting.
    before = os.environ.get(CHECK_ENV)
    os.environ.setdefault(CHECK_ENV, "0")
    try:
        return _run_benchmark(cfg)
    finally:
        if before is None:
            os.environ.pop(CHECK_ENV, None)
        else:
            os.environ[CHECK_ENV] = before


def _run_benchmark(cfg: BenchConfig) -> dict[str, Any] | None:
    device = resolve_device(cfg.run.device)
    init_distributed(device, cfg.run.collective_timeout_s)
    # Longer than the work timeout, so ranks waiting here outlive a peer stuck in a collective.
    ctrl = control_group(2 * cfg.run.collective_timeout_s + 120)
    rank = dist.get_rank()
    results: dict[str, Any] = {"meta": metadata(cfg, device), "config": cfg.to_dict(), "modes": {}}
    try:
        for name in cfg.run.modes:
            entry = run_mode(name, cfg, device, ctrl)
            if rank == 0:
                assert entry is not None
                results["modes"][name] = entry
                print(f"[bench] {name}: {entry['status']}" + (f" ({entry.get('error')})" if entry["status"] != "ok" else
                      f" total {entry['time_ms']['total']:.2f} ms"), flush=True)
                write_outputs(results, cfg, final=False)
        if rank == 0:
            write_outputs(results, cfg, final=True)
    finally:
        dist.barrier(group=ctrl)
        dist.destroy_process_group()
    return results if rank == 0 else None
