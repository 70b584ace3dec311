"""The MoE decoder under each way of training it on several ranks, for the MoE benchmarks
(``bench/moe_bytes.py`` on CPU processes, ``scripts/gpu_moe_ep2.py`` on two GPUs; its
:class:`PerExpertMuon` is also the plain baseline of ``scripts/gpu_moe_bench.py`` on one).

- ``ours``: ``matrix_shard`` with the decoder's expert stacks declared; ``expert_parallel_size=EP``
  (1: the stacks are owner-sharded roles like every matrix) and the package's ``Muon``.
- ``ddp``: stock ``DistributedDataParallel`` and :class:`PerExpertMuon`, ``torch.optim.Muon`` on
  every dense matrix and on each expert's gate, up and down as 2-D parameters of their own.
- ``fsdp2``: stock ``fully_shard`` per block and at the root; each stack is sharded on its expert
  dimension (FSDP2's ``Shard(0)``), so a rank's shard holds ``E/W`` whole experts, which
  :class:`PerExpertMuon` steps with ``torch.optim.Muon`` per expert on the local shard (no
  communication); the dense matrices are DTensors stepped by ``torch.optim.Muon`` directly (its
  collectives inside Newton-Schulz).

The decoder is ``bench/moe_model.py``'s with its experts modules given the Hugging Face experts
signature ``forward(hidden_states, top_k_index, top_k_weights)`` and ``act_fn``
(:class:`SeamExperts`): that is how expert parallelism finds them (docs/moe.md). The forward is
the same function; only the argument names differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .moe_model import EXPERT_STACKS, Experts, MoEConfig, MoEDecoder, is_muon_param

__all__ = ["LR", "ADAMW_LR", "WD", "MoEMode", "PerExpertMuon", "SeamExperts", "build_mode", "expert_blocks",
           "is_expert", "seam_decoder"]

LR, ADAMW_LR, WD = 0.02, 3e-4, 0.1


class SeamExperts(Experts):
    """``Experts`` with the Hugging Face experts module's argument names and ``act_fn`` (SiLU)."""

    act_fn = staticmethod(F.silu)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return super().forward(hidden_states, top_k_index, top_k_weights)


def seam_decoder(cfg: MoEConfig) -> MoEDecoder:
    """``MoEDecoder(cfg)`` (the same initialization) with :class:`SeamExperts` holding the same
    parameter objects as each block's ``Experts``."""
    model = MoEDecoder(cfg)
    for block in model.blocks:
        old = block.mlp.experts
        new = SeamExperts.__new__(SeamExperts)
        nn.Module.__init__(new)
        new.gate_up_proj, new.down_proj = old.gate_up_proj, old.down_proj
        block.mlp.experts = new
    return model


def is_expert(fqn: str) -> bool:
    """An expert stack of the decoder (``*.mlp.experts.gate_up_proj`` / ``down_proj``)."""
    return ".mlp.experts." in fqn


def expert_blocks(fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row blocks of one expert of a stack: gate_up as its two halves, down whole."""
    return (shape[1] // 2, shape[1] // 2) if fqn.endswith("gate_up_proj") else (shape[1],)


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class PerExpertMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on each dense matrix and on each expert's row blocks as 2-D parameters
    of their own (views sharing the stack's storage, on a DTensor the local shard's, their
    gradients the same views of the stack's gradient), ``torch.optim.AdamW`` on the rest
    (embedding, head, norms)."""

    def __init__(self, model: nn.Module) -> None:
        named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
        super().__init__([p for _, p in named], {"lr": LR})
        self.views: list[tuple[nn.Parameter, nn.Parameter, int, int, int]] = []
        muon, adamw = [], []
        for name, p in named:
            if is_expert(name):
                local = _local(p.data)
                for e in range(local.shape[0]):
                    start = 0
                    for rows in expert_blocks(name, tuple(p.shape)):
                        v = nn.Parameter(local[e, start:start + rows])
                        self.views.append((v, p, e, start, rows))
                        muon.append(v)
                        start += rows
            elif is_muon_param(name, p):
                muon.append(p)
            else:
                adamw.append(p)
        self.muon = torch.optim.Muon(muon, lr=LR, weight_decay=WD)
        self.adamw = torch.optim.AdamW(adamw, lr=ADAMW_LR, weight_decay=WD)
        self.matrices = len(muon)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:  # Lightning's automatic optimization: forward and backward first
            with torch.enable_grad():
                loss = closure()
        for v, p, e, start, rows in self.views:
            v.grad = None if p.grad is None else _local(p.grad)[e, start:start + rows]
        self.muon.step()
        self.adamw.step()
        for v, *_ in self.views:  # the views of this step's gradient: freed at zero_grad
            v.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        for v, *_ in self.views:
            v.grad = None

    def states(self) -> list[dict[str, Any]]:
        """Every per-parameter state of both inner optimizers."""
        return list(self.muon.state.values()) + list(self.adamw.state.values())


@dataclass
class MoEMode:
    """A built mode: the model to call, its optimizer and what the reports read."""

    name: str
    model: nn.Module
    optimizer: Any
    ep: int = 1
    stats_fn: Optional[Callable[[], dict]] = None  # the runtime's CommStats (ours)
    info: dict[str, Any] = field(default_factory=dict)

    def states(self) -> list[dict[str, Any]]:
        opt = self.optimizer
        if isinstance(opt, PerExpertMuon):
            return opt.states()
        return [s for s in opt.state.values() if isinstance(s, dict)]


def build_mode(name: str, cfg: MoEConfig, device: torch.device, ep: int = 1,
               group: Optional[Any] = None) -> MoEMode:
    """One mode on the decoder built from seed 0 (the same weights in every mode): ``ours``,
    ``ddp`` or ``fsdp2``; ``ep`` is ours' ``expert_parallel_size``."""
    import torch.distributed as dist

    torch.manual_seed(0)
    raw = seam_decoder(cfg)
    if name == "ours":
        import lightning_matrixfsdp as mf

        model = mf.matrix_shard(raw.to(device), expert_parallel_size=ep, expert_stacks=EXPERT_STACKS,
                                matrix_filter=is_muon_param, wrap_policy={type(raw.blocks[0])})
        opt = mf.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD)  # groups from the module: stacks per expert
        return MoEMode(f"ours_ep{ep}" if ep > 1 else "ours_no_ep", model, opt, ep,
                       stats_fn=lambda: mf.get_comm_stats(model, reset=True),
                       info={"plan": mf.get_plan(model)})
    if name == "ddp":
        from .modes import no_buffer_sync

        model = nn.parallel.DistributedDataParallel(raw.to(device), device_ids=[device.index]
                                                    if device.type == "cuda" else None, process_group=group,
                                                    **no_buffer_sync())
        return MoEMode("ddp_per_expert_muon", model, PerExpertMuon(model))
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if cfg.experts % world:
            raise ValueError(f"fsdp2 mode: {cfg.experts} experts do not split into whole experts over {world} ranks "
                             "(FSDP2 shards a stack on its expert dimension; a rank's shard must hold whole experts)")
        mesh = init_device_mesh(device.type, (world,))
        raw = raw.to(device)
        for block in raw.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(raw, mesh=mesh, reshard_after_forward=True)
        return MoEMode("fsdp2_per_expert_muon", raw, PerExpertMuon(raw))
    raise ValueError(f"unknown MoE mode {name!r} (ours, ddp, fsdp2)")
