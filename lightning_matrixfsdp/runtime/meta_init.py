"""Meta-device initialization with tensor or expert parallelism: whole tensors, initialized once.

Without either, each owner runs ``reset_parameters`` on its whole tensors. With tensor
parallelism an owner holds only its TP fragment, and running ``reset_parameters`` there would be
wrong twice: a rowwise-split ``nn.Linear`` would draw with the fragment's fan-in (bound
``1/sqrt(in/T)``, not ``1/sqrt(in)``), and each TP rank would draw its copy of a TP-replicated
parameter (a LayerNorm, a matrix the plan leaves whole) from its own generator, so the copies
would differ. With expert parallelism a rank holds only its experts ``[E/EP, ...]`` of each stack,
and a stack's random stream covers every expert in order. Instead, module by module in
``modules()`` order, every rank runs the module's ``reset_parameters`` on whole tensors of the
global shapes, put in place of the module's own parameters for the call: the random numbers drawn
are those of a one-process initialization of the unsplit model under the same seed (each rank's
generator advances as there, also where it keeps nothing). Then TP rank 0 of each owner's TP group
sends the other TP ranks their slices (and the whole tensor of a replicated parameter:
``tp/init_comm``), and global rank 0 sends every rank its experts of each stack (the scatter that
gives a CPU-built model rank 0's experts: ``expert_comm.rank0_slices``); the other ranks drop what
they drew. Memory: one module's parameters whole at a time.

``reset_parameters`` must initialize the module's own parameters only (torch's convention for
meta-device initialization): a parameter a parent's method writes is written to its resident
tensor (an expert stack: this rank's experts), not to the whole one. An experts module without
``reset_parameters`` keeps uninitialized experts, as a one-process meta initialization would (a
Hugging Face model's: for ``load_pretrained`` to fill).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.comm.core import CommStats
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.comm import rank0_slices
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.tags import expert_slice_of, tag_expert_slice
from lightning_matrixfsdp.runtime.tp.init_comm import scatter_initialized

__all__ = ["awaits_init", "init_tp_meta", "materialize_meta", "replays_whole"]


def awaits_init(p: Optional[torch.Tensor]) -> bool:
    """Whether parameter ``p`` is to be initialized as a meta-device one: on the meta device, or an
    expert stack built there (already this rank's uninitialized experts: ``ExpertParallel.split``)."""
    if p is None:
        return False
    s = expert_slice_of(p)
    return p.is_meta or (s is not None and s.from_meta)


def replays_whole(meta_modules: list[nn.Module], tp_plan: Any) -> bool:
    """Whether the meta-device modules are initialized here (whole tensors, then slices): with
    tensor parallelism, or where an expert stack under expert parallelism was on the meta device."""
    return bool(meta_modules) and (tp_plan is not None or any(
        p is not None and expert_slice_of(p) is not None for m in meta_modules for p in m._parameters.values()))


def _expert_stacks(m: nn.Module) -> list[tuple[str, nn.Parameter, Any]]:
    out, seen = [], set()
    for n, p in m._parameters.items():
        if awaits_init(p) and expert_slice_of(p) is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p, expert_slice_of(p)))
    return out


def init_tp_meta(meta_modules: list[nn.Module], params: list[ShardedParam], tp_plan: Any, tp: Any,
                 device: torch.device, stats: Any = None) -> None:
    """Initialize the parameters of ``meta_modules`` (in this order, the same on every rank) as a
    one-process initialization of the unsplit model would, and give each owner its TP fragment
    (``tp/plan``: None without tensor parallelism, each owner keeps its whole tensor) and each rank
    its experts of every expert stack. ``params``: every sharded parameter of the root (registered
    on the modules as residents); ``tp``: the TP group (``ShardGroup``). Collective over the TP
    group, and over the world where a module holds expert stacks."""
    by_id = {id(sp.resident): sp for sp in params}
    every = [s for m in meta_modules for s in _expert_stacks(m)]
    with torch.no_grad():
        for _, p, _ in every:  # uninitialized: a write by another module's reset_parameters shows (refused)
            if p.is_floating_point():
                p.fill_(float("nan"))
    for m in meta_modules:
        reset = getattr(m, "reset_parameters", None)
        own = [(name, by_id[id(p)]) for name, p in m._parameters.items() if p is not None and id(p) in by_id]
        stacks = _expert_stacks(m)
        if callable(reset) and (own or stacks):
            inside = [s for sub in m.modules() if sub is not m for s in _expert_stacks(sub)] if every else []
            _replay(m, reset, own, stacks, tp_plan, tp, device, stats)
            _refuse_written(m, inside)
        for _, p, s in stacks:  # initialized (without reset_parameters: uninitialized, as in one process)
            tag_expert_slice(p, replace(s, from_meta=False))


def _refuse_written(m: nn.Module, inside: list[tuple[str, nn.Parameter, Any]]) -> None:
    """Refuse (on every rank: the same code ran everywhere) a ``reset_parameters`` of ``m`` that
    wrote an expert stack of a module inside it: it drew for this rank's experts only, so neither
    those values nor the random stream after them are a one-process initialization's."""
    for _, p, s in inside:
        if p.is_floating_point() and not bool(torch.isnan(p).all()):
            raise MatrixShardError(
                f"meta-device initialization with expert parallelism: {type(m).__name__}.reset_parameters writes "
                f"the expert stack {s.fqn!r} of a module inside it. Each module's reset_parameters runs on whole "
                "tensors of its own parameters only, so this rank would draw for its own experts, and neither those "
                "values nor the random numbers after them would be a one-process initialization's. Initialize the "
                "stack in its own module's reset_parameters, build the model on the CPU, or load its weights "
                "(load_pretrained) into a model whose parents leave the experts alone")


def _replay(m: nn.Module, reset: Any, own: list[tuple[str, ShardedParam]], stacks: list[tuple[str, nn.Parameter, Any]],
            tp_plan: Any, tp: Any, device: torch.device, stats: Any) -> None:
    """``m.reset_parameters()`` on whole tensors in place of ``m``'s parameters; then every rank its part."""
    saved = dict(m._parameters)
    whole: dict[str, torch.Tensor] = {}
    for name, sp in own:
        shape = tp_plan.layouts[sp.shard.fqn].global_shape if tp_plan is not None else sp.shard.shape
        whole[name] = torch.empty(shape, dtype=sp.orig_dtype, device=device)
        m._parameters[name] = nn.Parameter(whole[name], requires_grad=sp.resident.requires_grad)
    for name, p, s in stacks:
        whole[name] = torch.empty(s.global_shape, dtype=p.dtype, device=device)
        m._parameters[name] = nn.Parameter(whole[name], requires_grad=p.requires_grad)
    try:
        with torch.no_grad():
            reset()
    finally:
        m._parameters.update(saved)
    mine = [(name, sp) for name, sp in own if sp.owned]
    if tp_plan is not None:
        scatter_initialized(tp, [tp_plan.layouts[sp.shard.fqn] for _, sp in mine],
                            [whole[name] if tp.rank == 0 else None for name, sp in mine],
                            [sp.resident.data for _, sp in mine], stats)
    else:
        with torch.no_grad():
            for name, sp in mine:
                sp.resident.data.copy_(whole[name])
    for name, p, s in stacks:  # the stage's first rank's experts to every rank (one process's init, its seed)
        source = dist.get_rank() == s.groups.source  # global rank 0 without pipeline parallelism
        local = rank0_slices(whole[name] if source else None, s.global_shape, p.dtype, s.groups,
                             stats if stats is not None else CommStats())
        with torch.no_grad():
            p.copy_(local)


def materialize_meta(root: nn.Module, meta_modules: list[nn.Module], device: torch.device) -> None:
    """Meta-device models: owners now hold uninitialized full tensors; run each module's
    ``reset_parameters`` (owners fill theirs, others touch empty placeholders)."""
    for m in root.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
            elif b is not None and b.device != device:
                m._buffers[name] = b.to(device)
    for m in meta_modules:
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
