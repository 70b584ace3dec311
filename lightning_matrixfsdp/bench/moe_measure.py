"""What one rank measures in the MoE bytes-and-memory benchmark (``bench/moe_bytes.py``).

Per mode, a few training steps of the MoE decoder, and on this rank:

- **bytes per step phase** (``fwd``, ``bwd``, ``opt``): every collective as the dispatcher sees it
  (``bench/comm.py``'s :class:`CommCounter`, any mode) and, for ours, the runtime's own
  ``CommStats`` read and reset at each phase boundary (``materialize``, ``reduce``,
  ``ep_dispatch``, ``ep_combine``, ``experts``, ...);
- **the routing**: each MoE layer's tokens per expert on this rank (a forward pre-hook on the
  experts module reads the router's top-k indices), from which the docs' token formula is
  evaluated once every rank's counts are known;
- **resident memory** after the last step: the storages of the parameters, their gradients and
  the optimizer's state, expert stacks apart from the dense part (each storage counted once);
- **the plan's bytes per unit** (ours): what each unit's materialization and reduction sends and
  receives on this rank, expert stacks apart, by the owner collective's byte convention; the
  report multiplies them by the number of passes and checks the sum against the measured phase.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import CommCounter
from .moe_model import MoEConfig
from .moe_modes import MoEMode, PerExpertMuon, build_mode, is_expert

__all__ = ["STEP_PHASES", "measure_mode", "plan_unit_bytes", "resident_bytes"]

STEP_PHASES = ("fwd", "bwd", "opt")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _batch(cfg: MoEConfig, step: int, rank: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)


def _routing_hooks(model: nn.Module, experts: int, record: list) -> list[Any]:
    """A pre-hook on each experts module: appends ``(layer, counts per expert)`` for each call."""
    handles = []
    layer = 0
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            def hook(_m: nn.Module, args: tuple, index: int = layer) -> None:
                record.append((index, torch.bincount(args[1].reshape(-1), minlength=experts).tolist()))
            handles.append(m.register_forward_pre_hook(hook))
            layer += 1
    return handles


def resident_bytes(mode: MoEMode) -> dict[str, Any]:
    """Bytes of this rank's tensors between steps, ``{expert, dense} x [params, grads, state]``
    (each tensor's ``numel x element size``; optimizer state matched to its parameter, for
    :class:`PerExpertMuon` a view to its stack), and the distinct storages behind all of them:
    ``storage`` (each allocation once, whole) against ``logical`` (the tensors' sum). A gradient
    may share one storage with other gradients (the owner's packed reduction buffer), so the
    storages are compared in total: ``storage == logical`` says no byte is held beyond the
    tensors (no padding, no overlap)."""
    named = {id(p): n.removeprefix("module.") for n, p in mode.model.named_parameters()}
    opt = mode.optimizer
    owner: dict[int, str] = dict(named)
    if isinstance(opt, PerExpertMuon):
        for v, p, *_ in opt.views:
            owner[id(v)] = named[id(p)]
    tensors: list[tuple[str, int, torch.Tensor]] = []
    for p in mode.model.parameters():
        tensors.append((named[id(p)], 0, p))
        if p.grad is not None:
            tensors.append((named[id(p)], 1, p.grad))
    for o in ([opt.muon, opt.adamw] if isinstance(opt, PerExpertMuon) else [opt]):
        for key, st in o.state.items():
            name = owner.get(id(key))
            for t in (st.values() if isinstance(st, dict) else ()):
                if isinstance(t, torch.Tensor) and name is not None and t.numel() > 1:  # not the step counters
                    tensors.append((name, 2, t))
    out: dict[str, Any] = {"expert": [0, 0, 0], "dense": [0, 0, 0], "storage": 0, "logical": 0}
    seen: set[tuple[int, int]] = set()
    for name, kind, t in tensors:
        t = _local(t)
        size = t.numel() * t.element_size()
        out["expert" if is_expert(name) else "dense"][kind] += size
        out["logical"] += size
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() and key not in seen:
            seen.add(key)
            out["storage"] += s.nbytes()
    return out


def plan_unit_bytes(plan: Any, rank: int) -> list[dict[str, Any]]:
    """Per unit of ``plan``, what one materialization and one reduction move on ``rank``, expert
    stacks (``e``) apart from the rest (``d``), by the owner collective's convention
    (``runtime/comm/collectives.py``): p2p: an owner sends its roles to each of the ``W-1`` others and
    every other rank receives them once; a reduction is the reverse. broadcast: the owner sends
    once. Frozen parameters are materialized but not reduced."""
    collective = plan.options.get("collective", "p2p")
    if collective not in ("p2p", "p2p_packed", "broadcast"):
        raise ValueError(f"plan_unit_bytes knows the p2p and broadcast conventions, not {collective!r}")
    fan = 1 if collective == "broadcast" else plan.world - 1
    units = []
    for u in plan.units:
        row = {"unit": u.fqn or "<root>", "root": not u.fqn}
        for key in ("mat_sent", "mat_recv", "red_sent", "red_recv"):
            row[key] = {"e": 0, "d": 0}
        if plan.world > 1:
            for s in u.shards:
                k = "e" if is_expert(s.fqn) else "d"
                mine = s.owner == rank
                row["mat_sent"][k] += fan * s.nbytes if mine else 0
                row["mat_recv"][k] += 0 if mine else s.nbytes
                if s.requires_grad:
                    row["red_sent"][k] += 0 if mine else s.nbytes
                    row["red_recv"][k] += (plan.world - 1) * s.nbytes if mine else 0
        units.append(row)
    return units


def _phase_bytes(totals: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    return {phase: [v["sent"], v["recv"]] for phase, v in totals.items() if v["sent"] or v["recv"]}


def _runtime(snap: dict[str, dict[str, int]]) -> dict[str, list[int]]:
    return {phase: [v["sent"], v["recv"]] for phase, v in snap.items() if v["sent"] or v["recv"]}


def measure_mode(name: str, cfg: MoEConfig, ep: int, steps: int, batch: int) -> dict[str, Any]:
    """``steps`` training steps of one mode on this rank; bytes summed over them per step phase
    (``dispatcher`` and, for ours, ``runtime``), the routing records, the resident bytes after the
    last step (gradients kept), the plan's unit bytes, and the losses."""
    rank = dist.get_rank()
    mode = build_mode(name, cfg, torch.device("cpu"), ep=ep)
    routing: list = []
    hooks = _routing_hooks(mode.model, cfg.experts, routing)
    if mode.stats_fn is not None:
        mode.stats_fn()  # the setup's init_sync: not a step's
    dispatcher: dict[str, dict[str, list[int]]] = {p: {} for p in STEP_PHASES}
    runtime: dict[str, dict[str, list[int]]] = {p: {} for p in STEP_PHASES}
    losses = []

    def add(into: dict[str, list[int]], got: dict[str, list[int]]) -> None:
        for k, (s, r) in got.items():
            cur = into.setdefault(k, [0, 0])
            cur[0] += s
            cur[1] += r

    for step in range(steps):
        t = _batch(cfg, step, rank, batch)
        mode.optimizer.zero_grad()
        for phase in STEP_PHASES:
            with CommCounter() as counter:
                counter.phase = "all"
                if phase == "fwd":
                    loss = mode.model(t[:, :-1], t[:, 1:])
                elif phase == "bwd":
                    loss.backward()
                else:
                    mode.optimizer.step()
            add(dispatcher[phase], {op: [v["sent"], v["recv"]] for op, v in counter.totals().get("all", {})
                                    .get("ops", {}).items()})
            if mode.stats_fn is not None:
                add(runtime[phase], _runtime(mode.stats_fn()))
        losses.append(float(loss.detach()))
    for h in hooks:
        h.remove()
    out: dict[str, Any] = {"mode": mode.name, "ep": ep, "dispatcher": dispatcher, "runtime": runtime,
                           "routing": routing, "memory": resident_bytes(mode), "losses": losses}
    plan = mode.info.get("plan")
    if plan is not None:
        out["units"] = plan_unit_bytes(plan, rank)
        out["collective"] = plan.options.get("collective")
    return out
