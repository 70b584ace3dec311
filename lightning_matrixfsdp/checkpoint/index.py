"""The key index: every ``state_dict`` key of a module, its owner, shape, role and local data.

Built once per save or load and handed to every step that needs it. Under owner
placement a parameter is whole on its owner and an empty placeholder elsewhere, so
``module.state_dict()`` alone cannot say what to write or where to read it; the index
adds that from the runtime's read-only view of the model (``views/checkpoint``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_matrixfsdp.checkpoint.agree import world
from lightning_matrixfsdp.checkpoint.errors import CheckpointError
from lightning_matrixfsdp.checkpoint.stages import Remote, join_stages
from lightning_matrixfsdp.runtime.views.checkpoint import (
    Chunked,
    ExpertChunk,
    Holding,
    Owned,
    Replicated,
    RootView,
    TPFragment,
    local_state_dict,
    model_view_of,
)
from lightning_matrixfsdp.runtime.tp.layout import fragment_dtensor

__all__ = ["Entry", "KeyIndex", "build_index"]


@dataclass(kw_only=True)
class Entry:
    """One tensor of the module's ``state_dict`` as this rank sees it."""

    key: str
    shape: tuple[int, ...]          # the whole (global) tensor's shape
    dtype: torch.dtype
    local: Optional[torch.Tensor]   # what this rank holds of it (whole, or its chunk), else None
    primary: str                    # first key of the same tensor (tied weights share one)
    holding: Holding                # how it is held: Replicated, Whole, TPFragment, ExpertSlice, ExpertBlock
    role: Optional[str] = None      # "matrix" / "tail" for sharded parameters

    @property
    def owned(self) -> Optional[Owned]:
        """Who owns it (``Whole``, ``TPFragment``); None where no owner holds it alone."""
        return self.holding if isinstance(self.holding, Owned) else None

    @property
    def chunk(self) -> Optional[Chunked]:
        """The chunk of the global tensor this rank holds (``TPFragment``, ``ExpertSlice``,
        ``ExpertBlock``); None where it is held whole."""
        return self.holding if isinstance(self.holding, Chunked) else None

    @property
    def experts(self) -> Optional[ExpertChunk]:
        """Some experts of an expert stack held on this rank (``ExpertSlice``, ``ExpertBlock``), else None."""
        return self.holding if isinstance(self.holding, ExpertChunk) else None

    @property
    def stepper(self) -> Optional[int]:
        """replica_split: the replica that steps it and holds its optimizer state (None: every replica)."""
        return self.owned.stepper if self.owned is not None else None

    @property
    def steps(self) -> bool:
        """Whether this rank's replica steps it (always, without replica_split)."""
        return self.owned.steps if self.owned is not None else True


@dataclass
class KeyIndex:
    entries: "OrderedDict[str, Entry]"
    extra: dict[str, Any]                       # non-tensor state (``get_extra_state``)
    order: dict[str, int]                       # key -> position in ``state_dict`` order
    key_of: dict[int, str]                      # id(parameter) -> primary key
    in_group0: bool                             # this rank belongs to global rank 0's shard group
    roots: list[RootView] = field(default_factory=list)  # every sharded root, as the sidecar records it
    tp_size: int = 1                            # tensor-parallel size of the sharded roots (1: none)
    tp_mesh: Any = None                         # their 1-D TP DeviceMesh (None without TP)
    pp_size: int = 1                            # pipeline stages' ranks (1: none)
    pp_rank: int = 0
    #: pipeline parallelism: the model's tensors other stages hold (their own index lists them)
    remote: dict[str, Remote] = field(default_factory=dict)
    #: every key of the whole model -> its position in the model's ``state_dict`` order (all stages')
    model_order: dict[str, int] = field(default_factory=dict)
    #: every tensor key -> the lowest global rank that holds its data (sends it to rank 0 for a file)
    senders: dict[str, int] = field(default_factory=dict)
    #: the non-tensor state (``get_extra_state``) other stages hold
    remote_extra: dict[str, Any] = field(default_factory=dict)
    #: pipeline parallelism: every stage's plan record (``plan_record``, with its ``"stage"``), in stage order
    stage_plans: list[dict[str, Any]] = field(default_factory=list)
    _aliases: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def plan_records(self) -> list[dict[str, Any]]:
        """The plans the sidecar records: every sharded root's, every stage's under pipeline parallelism."""
        return list(self.stage_plans) if self.pp_size > 1 else [plan_record(r) for r in self.roots]

    def position(self, key: str) -> int:
        """``key``'s place in the whole model's ``state_dict`` order (every stage's keys)."""
        return self.model_order[key] if key in self.model_order else self.order[key]

    def all_keys(self) -> list[str]:
        """Every tensor and object key of the model, this rank's and the other stages', in model order."""
        return sorted(set(self.order) | set(self.remote) | set(self.remote_extra), key=self.position)

    def key(self, p: torch.Tensor) -> str:
        """The primary key of an optimized parameter."""
        try:
            return self.key_of[id(p)]
        except KeyError:
            raise CheckpointError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not part of the module; "
                "checkpointing needs every optimized parameter to be registered in the LightningModule"
            ) from None

    def mine(self, key: str) -> bool:
        """Whether this rank holds the data of ``key`` (owned or replicated)."""
        return self.entries[self.entries[key].primary].local is not None

    def steps(self, key: str) -> bool:
        """Whether this rank holds (writes, reads) the optimizer state of ``key``: it holds the data
        and, under ``replica_split``, is in the replica that steps it."""
        e = self.entries[self.entries[key].primary]
        return e.local is not None and e.steps

    def mesh(self) -> dict[str, int]:
        """The (data-parallel, tensor-parallel[, pipeline-parallel]) mesh the sidecar records and a load compares."""
        size = world()[1]
        out = {"data_parallel": size // (self.tp_size * self.pp_size), "tensor_parallel": self.tp_size}
        return {**out, "pipeline_parallel": self.pp_size} if self.pp_size > 1 else out

    def fragment_shape(self, key: str) -> Optional[tuple[int, ...]]:
        """This TP rank's fragment shape of a TP-split ``key`` (None: not split); for an expert
        stack under expert parallelism, this rank's experts."""
        chunk = self.entries[self.entries[key].primary].chunk
        return chunk.local_shape if chunk is not None else None

    def part(self, key: str) -> int:
        """Which chunk of split ``key`` this rank holds: its expert-parallel rank for an expert
        stack, its shard rank for a split stack's block, else its TP rank."""
        chunk = self.entries[self.entries[key].primary].chunk
        return chunk.rank if chunk is not None else self.tp_rank

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank() if self.tp_mesh is not None else 0

    def as_saved(self, key: str, t: Any) -> Any:
        """``t`` as DCP gets it: a fragment of a TP-split ``key`` (the parameter or a state tensor of
        its fragment's shape) becomes a DTensor, so DCP records the global tensor with each TP
        rank's fragment as a chunk; anything else as it is."""
        shape = self.fragment_shape(key)
        if shape is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            return t
        return self._dtensor(key, t)

    def _dtensor(self, key: str, local: torch.Tensor) -> Any:
        chunk = self.entries[self.entries[key].primary].chunk
        assert chunk is not None  # callers ask for split keys only
        return fragment_dtensor(local, chunk.mesh, chunk.layout.dim, chunk.layout.global_shape)

    def fragment_request(self, key: str, dtype: torch.dtype) -> Any:
        """An empty DTensor of this TP rank's fragment of TP-split ``key``: DCP reads into it this
        rank's slice of the global tensor on disk, whatever chunks the save wrote (any mesh)."""
        e = self.entries[self.entries[key].primary]
        device = e.local.device if e.local is not None else torch.device("cpu")
        return self._dtensor(key, torch.empty(self.fragment_shape(key), dtype=dtype, device=device))

    def narrow(self, key: str, whole: torch.Tensor) -> torch.Tensor:
        """This TP rank's fragment of ``whole``, a global tensor of TP-split ``key`` (a view; ``whole``
        itself for a key that is not split)."""
        chunk = self.entries[self.entries[key].primary].chunk
        return whole if chunk is None else chunk.narrow(whole)

    def holds_whole_state(self, key: str) -> bool:
        """Whether this rank holds the whole-matrix optimizer state (Shampoo's, SOAP's) of ``key``:
        the TP stepper of a split matrix; any rank for a key that is not split or has no stepper."""
        h = self.entries[self.entries[key].primary].holding
        return not isinstance(h, TPFragment) or h.tp_stepper is None or h.tp_stepper == h.rank

    def aliases(self, primary: str) -> list[str]:
        """Every key of the tensor whose first key is ``primary`` (tied weights)."""
        if not self._aliases:
            for k, e in self.entries.items():
                self._aliases.setdefault(e.primary, []).append(k)
        return self._aliases.get(primary, [])


def build_index(module: nn.Module) -> KeyIndex:
    """Map the module's ``state_dict`` keys to owners, shapes and this rank's tensors.

    Collective under ``replica_split``: what the stepping replicas updated is sent to the
    others first (and waited for), so every replica's tensors are current for a save and
    no transfer in flight overwrites what a load writes (``views/checkpoint``)."""
    view = model_view_of(module)
    rank = world()[0]
    in_group0 = all(0 in r.global_ranks for r in view.roots) if view.roots else rank == 0
    entries: OrderedDict[str, Entry] = OrderedDict()
    extra: dict[str, Any] = {}
    first: dict[int, str] = {}
    key_of: dict[int, str] = {}
    full = local_state_dict(module, keep_vars=True)  # this rank's tensors, on purpose
    for key, v in full.items():
        if key in view.elsewhere:  # pipeline parallelism: another stage's (gathered below)
            continue
        p = view.params.get(key)
        if p is not None:
            primary = first.setdefault(p.ident, key)
            key_of[p.ident] = primary
            entries[key] = Entry(key=key, shape=p.shape, dtype=p.dtype, local=p.local, primary=primary,
                                 holding=p.holding, role=p.role)
        elif isinstance(v, torch.Tensor):
            primary = first.setdefault(id(v), key)
            key_of[id(v)] = primary
            entries[key] = Entry(key=key, shape=tuple(v.shape), dtype=v.dtype, local=v.detach(), primary=primary,
                                 holding=Replicated())
        else:
            extra[key] = v
    order = {k: i for i, k in enumerate(list(entries) + list(extra))}
    tp = [r for r in view.roots if r.tp_size > 1]
    index = KeyIndex(entries, extra, order, key_of, in_group0, list(view.roots), tp[0].tp_size if tp else 1,
                     tp[0].tp_mesh if tp else None)
    if view.pp_size > 1:  # collective: what the other stages hold
        pp = view.roots[0]
        index.pp_size, index.pp_rank = pp.pp_size, pp.pp_rank
        index.model_order = {k: i for i, k in enumerate(full)}
        index.remote, index.remote_extra, index.senders, index.stage_plans = join_stages(
            list(full), {k: _described(e) for k, e in entries.items()}, extra,
            sorted({r.stage for r in view.roots if r.stage is not None}),
            [{**plan_record(r), "stage": r.stage} for r in view.roots if r.stage is not None])
    return index


def plan_record(root: RootView) -> dict[str, Any]:
    """A sharded root's plan as the sidecar records it."""
    return {"prefix": root.prefix, "digest": root.plan.digest(), "plan": root.plan.to_dict()}


def _described(e: Entry) -> dict[str, Any]:
    """What other stages learn of an entry (``stages.join_stages``)."""
    owner = e.owned.owner if e.owned is not None else None
    return {"shape": e.shape, "dtype": e.dtype, "primary": e.primary, "role": e.role, "owner": owner,
            "layout": e.chunk.layout.to_dict() if e.chunk is not None else None, "data": e.local is not None}
