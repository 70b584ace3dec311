"""What checkpoints may know of a sharded model: a typed, read-only view built here.

Checkpointing (``lightning_matrixfsdp.checkpoint``) needs, for every ``state_dict`` key of
a sharded parameter, its owner, whole shape, role, this rank's data and its tied names,
and, for every sharded root, its plan and groups. It reads them from the frozen records
below, never from the runtime's state objects, so the runtime may change how it keeps
them. Dependencies run one way: checkpoint imports this module, nothing here imports
checkpoint.

``tag_view`` and ``view_key`` (the marks on ``state_dict`` tensors that stand for a
sharded model tensor) and ``local_state_dict`` (a sharded model's ``state_dict`` as this rank
holds it, which a plain ``state_dict()`` refuses: ``views/state_dict``) are re-exported so that
checkpoints import the runtime from here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.views.state_dict import local_state_dict
from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, stack_of, state_of, tag_view, view_key
from lightning_matrixfsdp.runtime.tp.layout import TPLayout

__all__ = ["ModelView", "ParamView", "RootView", "local_state_dict", "model_view_of", "note_loaded", "tag_view",
           "view_key"]


@dataclass(frozen=True)
class ParamView:
    """One sharded parameter as this rank sees it."""

    fqn: str                        # its name in the plan (relative to its root)
    names: tuple[str, ...]          # every key that reaches it from the module viewed (tied names)
    shape: tuple[int, ...]          # the whole tensor's shape
    dtype: torch.dtype
    owner: int                      # shard-group rank of the owner
    owner_global: int               # global rank of that owner
    role: str                       # "matrix" / "tail"
    local: Optional[torch.Tensor]   # the whole tensor (detached) where this rank owns it, else None
    stepper: Optional[int]          # replica_split: the replica that steps it and holds its optimizer state
    steps: bool                     # this rank's replica steps it (always, without replica_split)
    ident: int                      # id() of the parameter object optimizers hold
    #: tensor parallelism: the TP split of a parameter TP ranks hold different fragments of
    #: (``runtime.tp.TPLayout``; ``shape`` is then the global shape, ``local`` this TP rank's fragment)
    tp: Optional[Any] = None
    tp_stepper: Optional[int] = None  # the TP rank that steps a split matrix whole (None: every TP rank its fragment)
    #: expert parallelism: this rank's chunk of the split in ``tp`` (its expert-parallel rank; None: the
    #: TP rank's), the DeviceMesh of its expert-parallel group, and the global ranks that write chunk t
    part: Optional[int] = None
    part_mesh: Any = None
    part_sources: tuple[int, ...] = ()
    #: an expert stack the plan split into blocks of experts, one per owner of the shard group (``part``:
    #: this rank's block, ``part_mesh`` the shard group's DeviceMesh, ``part_sources`` its global ranks)
    split_stack: bool = False
    #: False for a parameter built on the meta device that no ``reset_parameters`` initialized and no
    #: load has written since: uninitialized memory (a load that leaves it so must say so)
    initialized: bool = True


@dataclass(frozen=True)
class RootView:
    """One module ``matrix_shard`` sharded."""

    prefix: str                     # its name in the module viewed
    plan: Plan
    span: int                       # shard-group size
    replicate: int                  # number of replicas (HSDP)
    global_ranks: tuple[int, ...]   # this rank's shard group, as global ranks
    tp_size: int = 1                # tensor-parallel size (1: none)
    tp_rank: int = 0                # this rank's place in its TP group
    tp_mesh: Any = None             # the 1-D TP DeviceMesh (None without tensor parallelism)


@dataclass(frozen=True)
class ModelView:
    """Every sharded root inside a module, and its sharded parameters by ``state_dict`` key."""

    roots: tuple[RootView, ...]
    params: Mapping[str, ParamView]  # read-only; tied names map to the same record


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _expert_views(prefix: str, experts: Any) -> dict[str, ParamView]:
    """Expert parallelism's local slices: each the ``Shard(0)`` chunk of its whole stack held by
    this expert-parallel rank (the split in ``tp``), written by the first expert-parallel group."""
    out = {}
    g = experts.groups
    for fqn, p in experts.params.items():
        s = expert_slice_of(p)
        key = _join(prefix, fqn)
        layout = TPLayout(fqn, 0, s.global_shape, (s.count,) * g.ep_size)
        out[key] = ParamView(fqn, (key,), s.global_shape, p.dtype, None, None,  # type: ignore[arg-type]
                             "matrix" if stack_of(p) is not None else "tail", p.detach(), None, True, id(p), layout,
                             None, g.ep_rank, experts.mesh, tuple(range(g.ep_size)))
    return out


def _block_view(sp: Any, names: tuple[str, ...], st: MatrixFSDPState) -> ParamView:
    """A split expert stack (``runtime/experts/split.py``): every rank of the shard group owns one block of
    experts, the ``Shard(0)`` chunk of the whole stack at its shard rank (the split in ``tp``), written
    by its owner. Served on one shard group (no HSDP replicas), so the chunks' writers are that group."""
    sizes = tuple(s.experts[1] - s.experts[0] for s in sp.pieces)
    layout = TPLayout(sp.shard.fqn, 0, tuple(sp.shard.shape), sizes)
    return ParamView(sp.shard.fqn, names, tuple(sp.shard.shape), sp.resident.dtype, None, None,  # type: ignore[arg-type]
                     sp.shard.role.value, sp.resident.detach(), None, True, id(sp.resident), layout, None,
                     st.sg.rank, st.stack_mesh, tuple(st.sg.global_ranks), True)


def model_view_of(module: nn.Module) -> ModelView:
    """The view of every sharded root inside ``module`` (``module`` itself included).

    Collective under ``replica_split``: what the stepping replicas updated is sent to the
    others first (and waited for), so every replica's ``local`` tensors are current and no
    transfer in flight overwrites what a checkpoint load writes into them. The keys come
    from each parameter's registrations, so they read right even while its unit is
    materialized."""
    paths: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    roots: list[RootView] = []
    params: dict[str, ParamView] = {}
    for prefix, root in module.named_modules():
        st: Optional[MatrixFSDPState] = state_of(root)
        if st is None:
            continue
        st.settle_replicas()
        m = st.mesh
        roots.append(RootView(prefix, st.plan, st.sg.size, st.replicate_size, tuple(st.sg.global_ranks), m.tp_size,
                              m.tp_rank, m.tp_mesh if m.tp_size > 1 else None))
        layouts = st.tp_plan.layouts if st.tp_plan is not None else {}
        tp_steppers = st.tp_plan.steppers if st.tp_plan is not None else {}
        replica = st.replica_rank
        for sp in st.params:
            names = tuple(_join(mname, pname) for m, pname in sp.registrations for mname in paths.get(id(m), []))
            shard, resident = sp.shard, sp.resident
            stepper = st.plan.stepper(shard.fqn)
            tp = layouts.get(shard.fqn)
            tp = tp if tp is not None and tp.split else None  # the plan holds this TP rank's fragment shapes
            shape = tuple(tp.global_shape) if tp is not None else tuple(shard.shape)
            if sp.split:  # a split expert stack: each owner's block a chunk of the whole, as expert parallelism's
                view = _block_view(sp, names, st)
            else:
                view = ParamView(shard.fqn, names, shape, resident.dtype, shard.owner, st.sg.g(shard.owner),
                                 shard.role.value, resident.detach() if is_owned(resident) else None, stepper,
                                 stepper is None or stepper == replica, id(resident), tp, tp_steppers.get(shard.fqn))
            params.update(dict.fromkeys(names, view))
        if st.experts is not None:
            params.update(_expert_views(prefix, st.experts))
        if st.uninitialized:  # one record per parameter, tied names included
            blank = {id(v): replace(v, initialized=False) for v in params.values() if v.ident in st.uninitialized}
            params = {k: blank.get(id(v), v) for k, v in params.items()}
    return ModelView(tuple(roots), MappingProxyType(params))


def note_loaded(module: nn.Module, idents: Iterable[int]) -> None:
    """A load wrote the parameters ``idents`` (``ParamView.ident``) of ``module``'s sharded roots:
    they hold values now (no longer ``initialized=False``). Local."""
    done = set(idents)
    for m in module.modules():
        st: Optional[MatrixFSDPState] = state_of(m)
        if st is not None:
            st.uninitialized -= done
