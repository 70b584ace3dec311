"""The optimizer state of a parameter at any (data-parallel, tensor-parallel) mesh: which kind
it is, what this rank restores of it, and handing it to a routed optimizer.

On disk every tensor-parallel split tensor is the *global* tensor, whatever mesh wrote it, so
a load at another mesh only has to know, per state tensor of a split parameter, which of two
kinds it is. The *target* optimizer says so (``optim.tail.keeps_whole_tp_state``), never the
chunks the save happened to write (those depend on the saving mesh):

* fragment state (Muon's momentum, AdamW's moments of a split tail, any optimizer of another
  package, which steps fragments as tensors of their own): sliced like the parameter. Each TP
  rank reads its slice of the global tensor; a rank without TP reads it whole. Such a tensor
  has the parameter's global shape or is a scalar; anything else cannot be sliced (or was
  written per fragment) and is refused.
* whole state (Shampoo's and SOAP's state of a split matrix): kept whole on the matrix's TP
  stepper, which writes it whole; only that rank reads it, whole (without TP: the owner, as always).

An expert stack under expert parallelism is split along its experts (dim 0), and every optimizer
keeps its state per expert: Muon's momentum and AdamW's moments shaped like the local stack,
Shampoo's and SOAP's statistics stacked with a leading dimension of the local experts
(``optim.matrix_library``). So every state tensor of such a stack with a leading dimension is a
chunk of the global ``[E, ...]`` state tensor (:func:`expert_state_layout`), written as this
rank's chunk and read as the chunk this rank holds now, or whole where the stack is whole now
(without expert parallelism); a scalar (a step count) is alike on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_matrixfsdp.checkpoint.formats import placeholder
from lightning_matrixfsdp.checkpoint.index import KeyIndex
from lightning_matrixfsdp.optim.routing import full_param_groups
from lightning_matrixfsdp.optim.tail import is_matrix_role, keeps_whole_tp_state
from lightning_matrixfsdp.runtime.tp.layout import TPLayout, fragment_dtensor

__all__ = ["StateRule", "apply_optimizer", "check_joinable", "expert_state_layout", "saved_splits", "state_as_saved",
           "whole_state"]


def whole_state(index: KeyIndex, optimizer: torch.optim.Optimizer, key: str) -> bool:
    """Whether ``optimizer``'s state of ``key`` is whole state: a matrix role that the optimizer
    steps with its matrix part (its param group decides: an embedding placed as a matrix role may
    be in the Muon recipe's AdamW group, whose moments are per fragment), and an optimizer that
    keeps a split matrix's state whole on its TP stepper (for a key that is not split: the same).
    Never for an expert stack under expert parallelism: its state is per expert, in chunks."""
    e = index.entries[index.entries[key].primary]
    return (keeps_whole_tp_state(optimizer) and e.role == "matrix" and e.experts is None
            and e.primary in _matrix_keys(index, optimizer))


def _matrix_keys(index: KeyIndex, optimizer: torch.optim.Optimizer) -> set[str]:
    """Primary keys of the parameters ``optimizer``'s groups route to its matrix part (every
    rank's lists, placeholders included), cached on the optimizer for this index and group sizes."""
    groups = full_param_groups(optimizer)
    sig = (id(index), tuple(len(ps) for ps in groups))
    cached = getattr(optimizer, "_mfsdp_matrix_keys", None)
    if cached is None or cached[0] != sig:
        keys = {index.key_of[id(p)] for g, ps in zip(optimizer.param_groups, groups) for p in ps
                if id(p) in index.key_of and is_matrix_role(p, g)}
        cached = (sig, keys)
        setattr(optimizer, "_mfsdp_matrix_keys", cached)
    return cached[1]


def expert_state_layout(index: KeyIndex, key: str, shape: Sequence[int], local: bool) -> Optional[TPLayout]:
    """For an expert stack under expert parallelism (else None): the split along the experts of
    its state tensor of ``shape``, this rank's chunk (``local``) or the global tensor on disk;
    None for a tensor without the leading expert dimension (a scalar)."""
    experts = index.entries[index.entries[key].primary].experts
    if experts is None or not len(shape):
        return None
    lay = experts.layout
    if shape[0] != (lay.sizes[experts.rank] if local else lay.global_shape[0]):
        return None
    return TPLayout(lay.fqn, 0, (lay.global_shape[0], *tuple(shape)[1:]), lay.sizes)


def state_as_saved(index: KeyIndex, optimizer: torch.optim.Optimizer, key: str, v: torch.Tensor) -> Any:
    """State tensor ``v`` of ``key`` as DCP gets it: whole state as it is; an expert stack's state
    with the leading expert dimension as this rank's chunk of the global tensor; a TP fragment's
    state as its chunk of the global tensor (``KeyIndex.as_saved``)."""
    experts = index.entries[index.entries[key].primary].experts
    if experts is not None:
        lay = expert_state_layout(index, key, v.shape, local=True)
        return v if lay is None else fragment_dtensor(v, experts.mesh, 0, lay.global_shape)
    return v if whole_state(index, optimizer, key) else index.as_saved(key, v)


def check_joinable(index: KeyIndex, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to save fragment state that cannot be joined into the whole matrix's: a tensor of a
    TP-split parameter's state that is neither whole state nor shaped like this rank's fragment
    (nor a scalar). Adafactor's row and column factors of a fragment are such state: each TP rank
    holds its own, the save would keep one rank's and drop the rest. Run it under ``agree``."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            key = index.key(p)
            frag = index.fragment_shape(key)
            if frag is None or p not in optimizer.state or not index.steps(key) or whole_state(index, optimizer, key):
                continue
            if index.entries[key].experts is not None:
                _check_expert_state(index, optimizer, key, optimizer.state[p])
                continue
            for name, v in optimizer.state[p].items():
                if isinstance(v, torch.Tensor) and v.ndim > 0 and tuple(v.shape) != frag:
                    raise CheckpointError(
                        f"optimizer state {name!r} of {key!r} has the shape {tuple(v.shape)}, not this tensor-parallel "
                        f"rank's fragment shape {frag}: {type(optimizer).__name__} keeps state per fragment that "
                        "cannot be joined into the whole matrix's, so a checkpoint cannot hold it (each TP rank's "
                        "would overwrite the others'). Use lightning_matrixfsdp.Muon, Shampoo or SOAP (whole-matrix "
                        "steps) or an elementwise optimizer for TP-split matrices, or keep this parameter replicated "
                        "in the parallelize plan")


def _check_expert_state(index: KeyIndex, optimizer: torch.optim.Optimizer, key: str, state: Mapping[str, Any]
                       ) -> None:
    count = index.fragment_shape(key)[0]  # type: ignore[index]
    for name, v in state.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0 and expert_state_layout(index, key, v.shape, True) is None:
            raise CheckpointError(
                f"optimizer state {name!r} of the expert stack {key!r} has the shape {tuple(v.shape)}, without this "
                f"rank's {count} experts as its leading dimension: {type(optimizer).__name__} keeps state that is not "
                "per expert, which cannot be joined into the whole stack's state under expert parallelism (each "
                "rank's would overwrite the others'). Use lightning_matrixfsdp.Muon, Shampoo or SOAP, or an "
                "elementwise optimizer, for expert stacks")


def saved_splits(layout: Optional[Mapping[str, Any]], from_ck: Mapping[str, str]) -> frozenset[str]:
    """Module keys that the save had split over TP (the ``tp`` records of a sidecar or a file's layout)."""
    params = layout.get("params") if isinstance(layout, Mapping) else None
    if not isinstance(params, Mapping):
        return frozenset()
    return frozenset(from_ck.get(k, k) for k, p in params.items() if isinstance(p, Mapping) and p.get("tp"))


@dataclass(frozen=True, eq=False)
class StateRule:
    """How this rank restores ``optimizer``'s state (``saved_split``: the keys the save had split)."""

    index: KeyIndex
    optimizer: torch.optim.Optimizer
    saved_split: Collection[str]
    what: str

    def whole(self, key: str) -> bool:
        return whole_state(self.index, self.optimizer, key)

    def reads(self, key: str) -> bool:
        """Whether this rank restores ``key``'s state at all (whole state: its TP stepper alone)."""
        return not self.whole(key) or self.index.holds_whole_state(key)

    def _sliced(self, key: str, name: str, shape: Sequence[int]) -> bool:
        """Whether state tensor ``name`` (saved ``shape``) of ``key`` is read as this rank's TP
        fragment; raises for fragment state of a split parameter that is not shaped like it."""
        e = self.index.entries[key]
        if e.experts is not None:  # an expert stack now: every tensor with the leading expert dimension
            return self._expert_sliced(key, name, shape)
        split_now = e.chunk is not None
        if self.whole(key) or not (split_now or key in self.saved_split):
            return False
        if tuple(shape) == tuple(e.shape):
            return split_now
        if len(shape) == 0:
            return False
        if not split_now and len(e.shape) > 2 and shape[0] == e.shape[0]:
            return False  # an expert stack's per-expert state [E, ...] (chunks under EP at the save): whole here
        where = (f"split along dim {e.chunk.layout.dim} here" if e.chunk is not None else "split over tensor parallelism at the save")
        raise CheckpointMismatchError(
            f"{self.what}: optimizer state {name!r} of {key!r} has the shape {tuple(shape)}, but {key!r} is "
            f"{where} (global shape {tuple(e.shape)}) and {type(self.optimizer).__name__} keeps that state sliced "
            "like the parameter, so each of its tensors must have the global shape (or be a scalar). It was written "
            "by another optimizer or per fragment; restore it with the optimizer and mesh that saved it, or load "
            "the weights only (load_weights) and restart the optimizer state")

    def _expert_sliced(self, key: str, name: str, shape: Sequence[int]) -> bool:
        if len(shape) == 0:
            return False
        if expert_state_layout(self.index, key, shape, local=False) is not None:
            return True
        e = self.index.entries[key]
        raise CheckpointMismatchError(
            f"{self.what}: optimizer state {name!r} of the expert stack {key!r} has the shape {tuple(shape)}, not "
            f"the {e.shape[0]} experts of the stack as its leading dimension, so this rank cannot take its "
            f"experts' part of it (expert parallelism here). It was written per rank (an older save with "
            "expert parallelism, or another optimizer); restore it with the optimizer and expert-parallel size "
            "that saved it, or load the weights only (load_weights) and restart the optimizer state")

    def dcp_buffer(self, key: str, name: str, m: Any) -> Any:
        """What DCP loads saved state entry ``m`` (storage metadata) of ``key`` into: this TP rank's
        fragment (a DTensor) of fragment state (of an expert stack: this rank's experts' chunk), else
        a CPU tensor of the saved size (None: object)."""
        size = getattr(m, "size", None)
        if size is None or not self._sliced(key, name, tuple(size)):
            return placeholder(m)
        e = self.index.entries[self.index.entries[key].primary]
        experts = e.experts
        if experts is None:
            return self.index.fragment_request(key, m.properties.dtype)
        lay = expert_state_layout(self.index, key, tuple(size), local=False)
        assert lay is not None  # _sliced said so
        device = e.local.device if e.local is not None else torch.device("cpu")
        local = torch.empty(lay.local_shape(experts.rank), dtype=m.properties.dtype, device=device)
        return fragment_dtensor(local, experts.mesh, 0, lay.global_shape)

    def from_file(self, key: str, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of ``key``'s whole saved state (a consolidated file): fragments
        copied out of fragment state, whole tensors copied."""
        out = {}
        for name, v in state.items():
            if isinstance(v, torch.Tensor):
                v = (self._narrow(key, v) if self._sliced(key, name, tuple(v.shape)) else v).clone()
            out[name] = v
        return out

    def _narrow(self, key: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole state tensor: its experts of an expert stack's, else its TP fragment."""
        experts = self.index.entries[self.index.entries[key].primary].experts
        if experts is None:
            return self.index.narrow(key, whole)
        lay = experts.layout
        return whole.narrow(0, lay.offset(experts.rank), lay.sizes[experts.rank])


def apply_optimizer(index: KeyIndex, optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]],
                    state: Mapping[str, Mapping[str, Any]]) -> None:
    """Give this rank's routed optimizer its parameters' state and the saved hyper-parameters."""
    native_state: dict[int, Any] = {}
    groups = []
    i = 0
    for g, sg in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in g["params"]:
            key = index.key(p)
            if key in state:
                native_state[i] = dict(state[key])
            ids.append(i)
            i += 1
        hp = {k: v for k, v in g.items() if k != "params"}
        hp.update({k: v for k, v in sg.items() if k not in ("params", "param_names")})
        groups.append({**hp, "params": ids})
    optimizer.load_state_dict({"state": native_state, "param_groups": groups})
