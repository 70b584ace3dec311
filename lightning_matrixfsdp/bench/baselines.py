"""Optimizer steps of the baseline approaches that torch does not ship.

- `GatherOnceMuon`: FSDP2's DTensor gradients are all-gathered once per matrix,
  orthogonalized whole on every rank, and each rank keeps its own row band.
- `OwnerStep`: ZeRO-1 owner placement: full parameters everywhere, each matrix
  updated by one owner (with `torch.optim.Muon`), then broadcast from it.

`GatherOnceMuon` follows `torch.optim.Muon`'s update rule (momentum lerp, Nesterov,
quintic Newton-Schulz in bfloat16, shape-based LR adjustment) with the library's own
functions for it: `newton_schulz` with one block (torch.optim.Muon's exact op sequence)
and `adjust_lr`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_matrixfsdp.optim.muon import adjust_lr
from lightning_matrixfsdp.optim.orthogonalize import newton_schulz


class GatherOnceMuon(torch.optim.Optimizer):
    """Muon for FSDP2 DTensor matrices: one all-gather per matrix per step.

    Momentum is elementwise, so it stays on the local shard; only the Nesterov
    update is gathered (`full_tensor`), orthogonalized on every rank, and sliced
    back without communication (`distribute_tensor(..., src_data_rank=None)`).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: Sequence[float],
        eps: float,
        ns_steps: int,
        adjust_lr_fn: str | None,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor) or p.ndim != 2:
                    raise ValueError("GatherOnceMuon expects 2D DTensor parameters (FSDP2)")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad: DTensor = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad.to_local())
                buf = state["momentum_buffer"]
                g_local = grad.to_local()
                buf.lerp_(g_local, 1 - group["momentum"])
                upd_local = g_local.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                upd = DTensor.from_local(
                    upd_local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
                )
                # blocks=1: torch.optim.Muon's op sequence (the gathered tensor is a fresh copy,
                # so the in-place normalization touches nothing else)
                ortho = newton_schulz(upd.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      blocks=1)
                local = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p_local = p.to_local()
                if local.shape != p_local.shape:
                    raise RuntimeError(f"local slice {tuple(local.shape)} does not match shard {tuple(p_local.shape)}")
                p_local.mul_(1 - group["lr"] * group["weight_decay"])
                p_local.add_(local, alpha=-adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def assign_owners(sizes: Sequence[int], world: int, how: str = "greedy") -> list[int]:
    """Owner rank per tensor: "round_robin" (i mod W) or "greedy" (largest first to the lightest rank).

    Deterministic: ties go to the lower rank, equal sizes keep their index order.
    """
    if how == "round_robin":
        return [i % world for i in range(len(sizes))]
    if how != "greedy":
        raise ValueError(f"unknown assignment {how!r}")
    loads = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += sizes[i]
    return owners


class OwnerStep:
    """ZeRO-1 owner placement over full (DDP-synchronized) parameters.

    Each rank builds torch's own Muon over the matrices it owns and AdamW over
    the other parameters it owns, steps them locally, then every parameter is
    broadcast from its owner (one asynchronous broadcast per tensor).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        matrix_names: set[str],
        owners: Sequence[int],
        group: dist.ProcessGroup,
        muon_kwargs: dict,
        adamw_kwargs: dict,
    ) -> None:
        self.params = [p for _, p in named_params]
        self.owners = list(owners)
        self.group = group
        me = group.rank()
        mine = [(n, p) for (n, p), o in zip(named_params, owners) if o == me]
        mats = [p for n, p in mine if n in matrix_names]
        rest = [p for n, p in mine if n not in matrix_names]
        self.optimizers: list[torch.optim.Optimizer] = []
        if mats:
            self.optimizers.append(torch.optim.Muon(mats, **muon_kwargs))
        if rest:
            self.optimizers.append(torch.optim.AdamW(rest, **adamw_kwargs))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        works = [
            dist.broadcast(p.data, src=dist.get_global_rank(self.group, o), group=self.group, async_op=True)
            for p, o in zip(self.params, self.owners)
        ]
        for w in works:
            w.wait()
