"""One builder per benchmark mode: model + sharding + optimizer -> a `TrainStep`.

Every builder starts from the same seed, so all modes train the same initial
weights on the same batches; only the way parameters are sharded, reduced and
updated differs. A builder that cannot run raises `ModeUnavailable` with a
status ("unavailable", "not installed") before any collective, so every rank
skips it consistently.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from .baselines import GatherOnceMuon, OwnerStep, assign_owners
from .config import BenchConfig
from .model import Decoder, is_matrix


class ModeUnavailable(RuntimeError):
    """The mode cannot run here (missing package or runtime); `status` goes into the report."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ModeContext:
    """What a builder needs from the runner."""

    cfg: BenchConfig
    device: torch.device
    group: dist.ProcessGroup  # the data-parallel group of this mode
    mesh: DeviceMesh  # 1-D mesh over `group`

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.run.dtype == "bfloat16" else torch.float32


@dataclass
class TrainStep:
    """A built mode: the four timed phases plus what the report wants to know."""

    name: str
    model: nn.Module  # the wrapped/sharded model that is called
    raw: nn.Module  # the underlying Decoder (for fqns and local sizes)
    optimizers: list[Any]
    zero_grad_fn: Callable[[], None] | None = None
    step_fn: Callable[[], None] | None = None
    comm_stats_fn: Callable[[bool], dict] | None = None  # runtime counters (matrix_fsdp)
    info: dict[str, Any] = field(default_factory=dict)
    owners: dict[str, int] | None = None  # fqn -> owner rank where a mode has owners
    # fqns whose optimizer update this rank runs, where that is fewer than it holds whole
    # (``replica_split``: one replica of each role steps it)
    stepped: set[str] | None = None

    def zero_grad(self) -> None:
        if self.zero_grad_fn is not None:
            self.zero_grad_fn()
            return
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        return self.model(tokens, targets)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        if self.step_fn is not None:
            self.step_fn()
            return
        for opt in self.optimizers:
            opt.step()


# ---------------------------------------------------------------- helpers
def preset_decoder(cfg: BenchConfig, device: torch.device) -> Decoder:
    """The configuration's decoder with the same initial weights for every mode and rank (seeded,
    built on the device, in the run's dtype); the GPU checkpoint scripts build theirs here too."""
    torch.manual_seed(cfg.run.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(cfg.run.seed)
    with torch.device(device):
        model = Decoder(cfg.model)
    return model.to(getattr(torch, cfg.run.dtype))


def build_model(ctx: ModeContext) -> Decoder:
    """The mode's decoder: :func:`preset_decoder` on the mode's device."""
    return preset_decoder(ctx.cfg, ctx.device)


def split_params(model: nn.Module, ctx: ModeContext) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon matrices, AdamW rest) by the shared `is_matrix` rule."""
    mats, rest = [], []
    for name, p in model.named_parameters():
        (mats if is_matrix(name, p, ctx.cfg.optim.matrix_scope) else rest).append(p)
    return mats, rest


def muon_kwargs(ctx: ModeContext) -> dict[str, Any]:
    o = ctx.cfg.optim
    return dict(
        lr=o.lr,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_coefficients=tuple(o.ns_coefficients),
        eps=o.eps,
        ns_steps=o.ns_steps,
        adjust_lr_fn=o.adjust_lr_fn,
    )


def adamw_kwargs(ctx: ModeContext) -> dict[str, Any]:
    o = ctx.cfg.optim
    return dict(lr=o.adamw_lr, betas=tuple(o.adamw_betas), eps=o.adamw_eps, weight_decay=o.adamw_weight_decay)


def apply_fsdp2(model: Decoder, ctx: ModeContext) -> Decoder:
    """FSDP2 the torchtitan way: each block a unit, then the root for the leftovers."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=True)
    fully_shard(model, mesh=ctx.mesh, reshard_after_forward=True)
    return model


def no_buffer_sync() -> dict[str, bool]:
    """DDP's option for no buffer broadcast before each forward: the bench models have no changing buffers.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and warns on the old
    name; torch 2.11 knows only the old one.
    """
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def apply_ddp(model: Decoder, ctx: ModeContext) -> nn.Module:
    """Full replicas with bucketed, backward-overlapped gradient all-reduce (averaged)."""
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=ctx.group,
        gradient_as_bucket_view=True,
        **no_buffer_sync(),
    )


# ------------------------------------------------------------------ modes
def build_fsdp2_adamw(ctx: ModeContext) -> TrainStep:
    """The AdamW lower bound: FSDP2 + torch.optim.AdamW on every parameter."""
    model = apply_fsdp2(build_model(ctx), ctx)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(ctx))
    return TrainStep("fsdp2_adamw", model, model, [opt])


def build_fsdp2_muon(ctx: ModeContext) -> TrainStep:
    """Stock FSDP2 + torch.optim.Muon directly on the DTensor matrices (+ AdamW)."""
    model = apply_fsdp2(build_model(ctx), ctx)
    mats, rest = split_params(model, ctx)
    opts = [torch.optim.Muon(mats, **muon_kwargs(ctx)), torch.optim.AdamW(rest, **adamw_kwargs(ctx))]
    return TrainStep("fsdp2_muon", model, model, opts)


def build_fsdp2_gather_once(ctx: ModeContext) -> TrainStep:
    """FSDP2; the optimizer all-gathers each matrix update once and keeps its slice."""
    model = apply_fsdp2(build_model(ctx), ctx)
    mats, rest = split_params(model, ctx)
    opts = [GatherOnceMuon(mats, **muon_kwargs(ctx)), torch.optim.AdamW(rest, **adamw_kwargs(ctx))]
    return TrainStep("fsdp2_gather_once", model, model, opts)


def build_muon_fsdp2(ctx: ModeContext) -> TrainStep:
    """The published `muon-fsdp2` package (gather to owner i mod W, scatter back)."""
    try:
        import muon_fsdp2  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError or anything its import raises
        raise ModeUnavailable("not installed", f"muon_fsdp2 import failed: {type(exc).__name__}: {exc}") from exc
    model = apply_fsdp2(build_model(ctx), ctx)
    mats, rest = split_params(model, ctx)
    o = ctx.cfg.optim
    groups = [
        dict(params=mats, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, use_muon=True,
             rms_scale=o.adjust_lr_fn == "match_rms_adamw", nesterov=o.nesterov, ns_steps=o.ns_steps),
        dict(params=rest, lr=o.adamw_lr, betas=tuple(o.adamw_betas), eps=o.adamw_eps,
             weight_decay=o.adamw_weight_decay, use_muon=False),
    ]
    opt = muon_fsdp2.Muon(groups)
    version = getattr(muon_fsdp2, "__version__", "unknown")
    return TrainStep("muon_fsdp2", model, model, [opt], info={"package_version": version})


def _owner_setup(ctx: ModeContext) -> tuple[Decoder, list[tuple[str, nn.Parameter]], set[str]]:
    raw = build_model(ctx)
    named = list(raw.named_parameters())
    matrices = {n for n, p in named if is_matrix(n, p, ctx.cfg.optim.matrix_scope)}
    return raw, named, matrices


def build_zero1_owner(ctx: ModeContext) -> TrainStep:
    """ZeRO-1 owner placement: DDP grads, owner-local Muon/AdamW, broadcast updated params."""
    raw, named, matrices = _owner_setup(ctx)
    model = apply_ddp(raw, ctx)
    sizes = [p.numel() * p.element_size() for _, p in named]
    owners = assign_owners(sizes, ctx.group.size(), ctx.cfg.run.zero1_assignment)
    stepper = OwnerStep(named, matrices, owners, ctx.group, muon_kwargs(ctx), adamw_kwargs(ctx))
    return TrainStep(
        "zero1_owner",
        model,
        raw,
        stepper.optimizers,
        zero_grad_fn=stepper.zero_grad,
        step_fn=stepper.step,
        owners={n: o for (n, _), o in zip(named, owners)},
        info={"assignment": ctx.cfg.run.zero1_assignment},
    )


def build_ddp_muon(ctx: ModeContext) -> TrainStep:
    """The full-matrix reference: DDP-averaged grads, torch Muon + AdamW on every rank."""
    raw, named, matrices = _owner_setup(ctx)
    model = apply_ddp(raw, ctx)
    mats = [p for n, p in named if n in matrices]
    rest = [p for n, p in named if n not in matrices]
    opts = [torch.optim.Muon(mats, **muon_kwargs(ctx)), torch.optim.AdamW(rest, **adamw_kwargs(ctx))]
    return TrainStep("ddp_muon", model, raw, opts)


def build_matrix_fsdp(ctx: ModeContext, collective: str, orthogonalizer: str = "newton_schulz",
                      hsdp: bool = False, replica_split: bool = False) -> TrainStep:
    """Our owner-sharded ZeRO-3 runtime with one collective implementation (and, for
    the ``_fast`` mode, the opt-in hybrid orthogonalizer instead of torch's numerics).

    ``hsdp``: shard over ``run.hsdp_shard_size`` ranks and replicate across the rest
    (``matrix_hsdp``), with ``replica_split`` each role stepped by one replica
    (``matrix_hsdp_split``). The updated weights then reach the other replicas through
    the runtime's lazy start at the next forward (bench/runner.py synchronizes the device
    at the end of the optimizer phase, so a transfer started there would not overlap)."""
    try:
        from lightning_matrixfsdp import Muon, get_comm_stats, get_plan, matrix_shard
    except Exception as exc:
        raise ModeUnavailable("unavailable", f"lightning_matrixfsdp runtime import failed: {type(exc).__name__}: {exc}") from exc
    shard_size = ctx.cfg.run.hsdp_shard_size if hsdp else None
    if shard_size is not None and ctx.group.size() % shard_size:
        raise ModeUnavailable("unavailable", f"hsdp_shard_size={shard_size} does not divide the world "
                                             f"size {ctx.group.size()}")
    raw = build_model(ctx)
    scope = ctx.cfg.optim.matrix_scope
    model = matrix_shard(
        raw,
        mesh=None if hsdp else ctx.mesh,
        shard_size=shard_size,
        replica_split=replica_split,
        planner=ctx.cfg.run.planner,
        collective=collective,
        matrix_filter=lambda fqn, p: is_matrix(fqn, p, scope),
    )
    o = ctx.cfg.optim
    opt = Muon(
        model.parameters(),
        **muon_kwargs(ctx),
        adamw_lr=o.adamw_lr,
        adamw_betas=tuple(o.adamw_betas),
        adamw_eps=o.adamw_eps,
        adamw_weight_decay=o.adamw_weight_decay,
        orthogonalizer=orthogonalizer,
    )
    info: dict[str, Any] = {"collective": collective, "planner": ctx.cfg.run.planner,
                            "orthogonalizer": orthogonalizer}
    stepped = None
    try:
        plan = get_plan(model)
        info["plan"] = plan.to_dict()
        info["plan_text"] = str(plan)
        if plan.replica_split:  # hsdp_mesh: replica k holds global ranks k*W .. k*W+W-1
            me = ctx.group.rank() // plan.world
            stepped = {f for f, k in plan.steppers.items() if k == me}
    except Exception as exc:  # the report still runs without the plan
        info["plan_error"] = f"{type(exc).__name__}: {exc}"
    if hsdp:
        info.update(shard_size=shard_size, replica_split=replica_split)
        name = "matrix_hsdp" + ("_split" if replica_split else "")
    else:
        name = f"matrix_fsdp_{collective}" + ("" if orthogonalizer == "newton_schulz" else "_fast")
    return TrainStep(
        name,
        model,
        model,
        [opt],
        comm_stats_fn=lambda reset=False: get_comm_stats(model, reset=reset),
        info=info,
        stepped=stepped,
    )


Builder = Callable[[ModeContext], TrainStep]

BUILDERS: dict[str, Builder] = {
    "fsdp2_adamw": build_fsdp2_adamw,
    "fsdp2_muon": build_fsdp2_muon,
    "fsdp2_gather_once": build_fsdp2_gather_once,
    "muon_fsdp2": build_muon_fsdp2,
    "zero1_owner": build_zero1_owner,
    "ddp_muon": build_ddp_muon,
    "matrix_fsdp_p2p": functools.partial(build_matrix_fsdp, collective="p2p"),
    "matrix_fsdp_broadcast": functools.partial(build_matrix_fsdp, collective="broadcast"),
    "matrix_fsdp_padded_all_gather": functools.partial(build_matrix_fsdp, collective="padded_all_gather"),
    "matrix_fsdp_p2p_packed": functools.partial(build_matrix_fsdp, collective="p2p_packed"),
    "matrix_fsdp_p2p_fast": functools.partial(build_matrix_fsdp, collective="p2p", orthogonalizer="fast"),
    "matrix_hsdp": functools.partial(build_matrix_fsdp, collective="p2p", hsdp=True),
    "matrix_hsdp_split": functools.partial(build_matrix_fsdp, collective="p2p", hsdp=True, replica_split=True),
}
