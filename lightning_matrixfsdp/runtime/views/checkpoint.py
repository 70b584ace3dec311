"""What checkpoints may know of a sharded model: a typed, read-only view built here.

Checkpointing (``lightning_matrixfsdp.checkpoint``) needs, for every ``state_dict`` key of
a sharded parameter, its whole shape, role, this rank's data, its tied names and how this
rank holds it, and, for every sharded root, its plan and groups. It reads them from the
frozen records below, never from the runtime's state objects, so the runtime may change how
it keeps them. Dependencies run one way: checkpoint imports this module, nothing here imports
checkpoint.

How a tensor is held is one record per way (``ParamView.holding``), so the checkpoint code
branches on the type and each record carries only what that way has:

* ``Whole``: whole on one owner of the shard group (a placeholder on the others);
* ``TPFragment``: tensor parallelism, this TP rank's fragment on one owner;
* ``ExpertSlice``: expert parallelism, this rank's ``[E/EP, ...]`` experts, on every rank;
* ``ExpertBlock``: a split expert stack, the block of experts this rank owns;
* ``Replicated``: whole on every rank (the checkpoint's own records of buffers and unsharded
  tensors; no ``ParamView`` has it).

``Owned`` (``Whole``, ``TPFragment``) says who owns it; ``Chunked`` (``TPFragment`` and the
two expert records, ``ExpertChunk``) which chunk of the global tensor this rank holds.

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
from lightning_matrixfsdp.runtime.tags import (
    expert_slice_of,
    is_owned,
    is_stage,
    pipeline_of,
    sharded_roots,
    stack_of,
    state_of,
    tag_view,
    view_key,
)
from lightning_matrixfsdp.runtime.tp.layout import TPLayout

__all__ = ["Chunked", "ExpertBlock", "ExpertChunk", "ExpertSlice", "Holding", "ModelView", "Owned", "ParamView",
           "Replicated", "RootView", "TPFragment", "Whole", "local_state_dict", "model_view_of", "note_loaded",
           "stage_roots", "tag_view", "view_key"]


# ---------------------------------------------------------------------- how a tensor is held
# One record per way this rank can hold a tensor of the model; checkpoints branch on the type.
@dataclass(frozen=True, kw_only=True)
class Holding:
    """How this rank holds one tensor of the model (a subclass says which way)."""


@dataclass(frozen=True, kw_only=True)
class Replicated(Holding):
    """Whole on every rank: a buffer, or a tensor ``matrix_shard`` did not shard."""


@dataclass(frozen=True, kw_only=True)
class Owned(Holding):
    """On one owner of each shard group, an empty placeholder on its other ranks."""

    owner: int                      # shard-group rank of the owner
    owner_global: int               # global rank of that owner in this rank's shard group
    stepper: Optional[int] = None   # replica_split: the replica that steps it and holds its optimizer state
    steps: bool = True              # this rank's replica steps it (always, without replica_split)


@dataclass(frozen=True, kw_only=True)
class Chunked(Holding):
    """The whole tensor is cut along ``layout.dim`` into one chunk per rank of ``mesh``
    (``layout.sizes``; DCP writes each as its chunk of the global tensor); this rank's is
    chunk ``rank``."""

    layout: TPLayout                # the cut (``global_shape``: the whole tensor's)
    rank: int                       # which chunk this rank holds
    mesh: Any                       # the 1-D DeviceMesh the chunks are spread over

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.layout.local_shape(self.rank))

    def bounds(self, rank: Optional[int] = None) -> tuple[int, int, int]:
        """``(dim, start, length)`` of chunk ``rank`` (this rank's by default) in the whole tensor."""
        r = self.rank if rank is None else rank
        return int(self.layout.dim), self.layout.offset(r), self.layout.sizes[r]  # type: ignore[arg-type]

    def narrow(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``whole`` (a view)."""
        return whole.narrow(*self.bounds())


@dataclass(frozen=True, kw_only=True)
class Whole(Owned):
    """Whole on its owner: the way owner sharding holds a matrix."""


@dataclass(frozen=True, kw_only=True)
class TPFragment(Owned, Chunked):
    """Tensor parallelism: the owner holds this TP rank's fragment of the global tensor (``rank``:
    the TP rank, ``mesh``: the TP mesh); the owner's TP peers hold the others."""

    tp_stepper: Optional[int] = None  # the TP rank that steps the matrix whole (None: every TP rank its fragment)


@dataclass(frozen=True, kw_only=True)
class ExpertChunk(Chunked):
    """Some experts of an expert stack (a chunk along dim 0) held on this rank, not on an owner."""

    writers: tuple[int, ...]        # the global ranks that write chunk t to checkpoints


@dataclass(frozen=True, kw_only=True)
class ExpertSlice(ExpertChunk):
    """Expert parallelism: this rank's ``[E/EP, ...]`` experts (``rank``: its expert-parallel rank,
    ``mesh``: its expert-parallel group), written by the first expert-parallel group."""


@dataclass(frozen=True, kw_only=True)
class ExpertBlock(ExpertChunk):
    """A split expert stack (``runtime/experts/split.py``): the block of experts this rank owns
    (``rank``: its shard rank, ``mesh``: the shard group), written by its owner."""


@dataclass(frozen=True, kw_only=True)
class ParamView:
    """One sharded parameter as this rank sees it."""

    fqn: str                        # its name in the plan (relative to its root)
    names: tuple[str, ...]          # every key that reaches it from the module viewed (tied names)
    shape: tuple[int, ...]          # the whole tensor's shape
    dtype: torch.dtype
    role: str                       # "matrix" / "tail"
    local: Optional[torch.Tensor]   # what this rank holds of it (detached; a chunk where ``holding`` is one), else None
    ident: int                      # id() of the parameter object optimizers hold
    holding: Holding                # how it is held: Whole, TPFragment, ExpertSlice or ExpertBlock
    #: False for a parameter built on the meta device that no ``reset_parameters`` initialized and no
    #: load has written since: uninitialized memory (a load that leaves it so must say so)
    initialized: bool = True


@dataclass(frozen=True, kw_only=True)
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
    pp_size: int = 1                # pipeline stages' ranks (1: no pipeline parallelism)
    pp_rank: int = 0                # this rank's place on the pipeline axis
    stage: Optional[int] = None     # the pipeline stage this root is (None: not a stage)


@dataclass(frozen=True)
class ModelView:
    """Every sharded root inside a module, and its sharded parameters by ``state_dict`` key.

    Under pipeline parallelism the roots are this rank's stages, keyed by the whole model's
    names; ``elsewhere``: the keys of the model that other stages hold (not this rank's)."""

    roots: tuple[RootView, ...]
    params: Mapping[str, ParamView]  # read-only; tied names map to the same record
    elsewhere: frozenset[str] = frozenset()

    @property
    def pp_size(self) -> int:
        return max((r.pp_size for r in self.roots), default=1)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _expert_views(prefix: str, experts: Any) -> dict[str, ParamView]:
    """Expert parallelism's local slices: each the ``Shard(0)`` chunk of its whole stack held by
    this expert-parallel rank, written by the first expert-parallel group."""
    out = {}
    g = experts.groups
    for fqn, p in experts.params.items():
        s = expert_slice_of(p)
        key = _join(prefix, fqn)
        holding = ExpertSlice(layout=TPLayout(fqn, 0, s.global_shape, (s.count,) * g.ep_size), rank=g.ep_rank,
                              mesh=experts.mesh, writers=tuple(range(g.ep_size)))
        out[key] = ParamView(fqn=fqn, names=(key,), shape=s.global_shape, dtype=p.dtype,
                             role="matrix" if stack_of(p) is not None else "tail", local=p.detach(), ident=id(p),
                             holding=holding)
    return out


def _block_view(sp: Any, names: tuple[str, ...], st: MatrixFSDPState) -> ParamView:
    """A split expert stack (``runtime/experts/split.py``): every rank of the shard group owns one block of
    experts, the ``Shard(0)`` chunk of the whole stack at its shard rank, written by its owner. Served on
    one shard group (no HSDP replicas), so the chunks' writers are that group."""
    shape = tuple(sp.shard.shape)
    sizes = tuple(s.experts[1] - s.experts[0] for s in sp.pieces)
    holding = ExpertBlock(layout=TPLayout(sp.shard.fqn, 0, shape, sizes), rank=st.sg.rank, mesh=st.stack_mesh,
                          writers=tuple(st.sg.global_ranks))
    return ParamView(fqn=sp.shard.fqn, names=names, shape=shape, dtype=sp.resident.dtype, role=sp.shard.role.value,
                     local=sp.resident.detach(), ident=id(sp.resident), holding=holding)


def _owned_view(sp: Any, names: tuple[str, ...], st: MatrixFSDPState) -> ParamView:
    """A parameter on one owner of the shard group: whole, or with tensor parallelism this TP rank's
    fragment of it (``shape`` global)."""
    shard, resident = sp.shard, sp.resident
    stepper = st.plan.stepper(shard.fqn)
    owner = {"owner": shard.owner, "owner_global": st.sg.g(shard.owner), "stepper": stepper,
             "steps": stepper is None or stepper == st.replica_rank}
    tp = st.tp_plan.layouts.get(shard.fqn) if st.tp_plan is not None else None
    if tp is not None and tp.split:  # the plan holds this TP rank's fragment shapes
        holding: Holding = TPFragment(layout=tp, rank=st.mesh.tp_rank, mesh=st.mesh.tp_mesh,
                                      tp_stepper=st.tp_plan.steppers.get(shard.fqn), **owner)
        shape = tuple(tp.global_shape)
    else:
        holding, shape = Whole(**owner), tuple(shard.shape)
    return ParamView(fqn=shard.fqn, names=names, shape=shape, dtype=resident.dtype, role=shard.role.value,
                     local=resident.detach() if is_owned(resident) else None, ident=id(resident), holding=holding)


def stage_roots(module: nn.Module) -> list[nn.Module]:
    """Under pipeline parallelism, this rank's stages of the pipelined model inside ``module`` (what
    this rank saves); ``[]`` without pipeline parallelism."""
    return [r for r in sharded_roots(module) if is_stage(r)]


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
    elsewhere: set[str] = set()
    for prefix, root in module.named_modules():
        run = pipeline_of(root)
        if run is not None:  # the whole model of a pipeline: this rank's stages are its roots
            elsewhere |= _pipeline_roots(prefix, root, run, paths, roots, params)
            continue
        st: Optional[MatrixFSDPState] = state_of(root)
        if st is not None and not any(prefix.startswith(r.prefix + ".") for r in roots if r.stage is not None):
            _add_root(prefix, st, paths, roots, params)
    return ModelView(tuple(roots), MappingProxyType(params), frozenset(elsewhere))


def _add_root(prefix: str, st: MatrixFSDPState, paths: dict[int, list[str]], roots: list[RootView],
              params: dict[str, ParamView], **pipeline: Any) -> None:
    """One sharded root: its record and its parameters' (keys from their registrations in the module viewed)."""
    st.settle_replicas()
    m = st.mesh
    roots.append(RootView(prefix=prefix, plan=st.plan, span=st.sg.size, replicate=st.replicate_size,
                          global_ranks=tuple(st.sg.global_ranks), tp_size=m.tp_size, tp_rank=m.tp_rank,
                          tp_mesh=m.tp_mesh if m.tp_size > 1 else None, **pipeline))
    for sp in st.params:
        names = tuple(_join(mname, pname) for m, pname in sp.registrations for mname in paths.get(id(m), []))
        view = _block_view(sp, names, st) if sp.split else _owned_view(sp, names, st)
        params.update(dict.fromkeys(names, view))
    if st.experts is not None:
        params.update(_expert_views(prefix, st.experts))
    if st.uninitialized:  # one record per parameter, tied names included
        blank = {id(v): replace(v, initialized=False) for v in params.values() if v.ident in st.uninitialized}
        params.update({k: blank[id(v)] for k, v in params.items() if id(v) in blank})


def _pipeline_roots(prefix: str, model: nn.Module, run: Any, paths: dict[int, list[str]], roots: list[RootView],
                    params: dict[str, ParamView]) -> set[str]:
    """The stages this rank runs of ``model`` (at ``prefix`` in the module viewed) as sharded roots.
    A stage registers the model's own modules under their global names, so its keys, read from the
    registrations, are the whole model's; returns the model's keys that other stages hold."""
    mine: set[str] = set()
    for stage, index in zip(run.stages, run.stage_indices):
        st: Optional[MatrixFSDPState] = state_of(stage)
        if st is None:
            continue
        _add_root(prefix, st, paths, roots, params, pp_size=run.mesh.pp_size, pp_rank=run.mesh.pp_rank, stage=index)
        mine.update(_join(prefix, k) for k in local_state_dict(stage, keep_vars=True))
    return {_join(prefix, k) for k in local_state_dict(model, keep_vars=True)} - mine


def note_loaded(module: nn.Module, idents: Iterable[int]) -> None:
    """A load wrote the parameters ``idents`` (``ParamView.ident``) of ``module``'s sharded roots:
    they hold values now (no longer ``initialized=False``). Local."""
    done = set(idents)
    for m in module.modules():
        st: Optional[MatrixFSDPState] = state_of(m)
        if st is not None:
            st.uninitialized -= done
