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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_matrixfsdp.checkpoint.formats import placeholder
from lightning_matrixfsdp.checkpoint.index import KeyIndex
from lightning_matrixfsdp.optim.tail import keeps_whole_tp_state

__all__ = ["StateRule", "apply_optimizer", "check_joinable", "saved_splits", "whole_state"]


def whole_state(index: KeyIndex, optimizer: torch.optim.Optimizer, key: str) -> bool:
    """Whether ``optimizer``'s state of ``key`` is whole state: a matrix role, and an optimizer that
    keeps a split matrix's state whole on its TP stepper (for a key that is not split: the same)."""
    return keeps_whole_tp_state(optimizer) and index.entries[key].role == "matrix"


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
            for name, v in optimizer.state[p].items():
                if isinstance(v, torch.Tensor) and v.ndim > 0 and tuple(v.shape) != frag:
                    raise CheckpointError(
                        f"optimizer state {name!r} of {key!r} has the shape {tuple(v.shape)}, not this tensor-parallel "
                        f"rank's fragment shape {frag}: {type(optimizer).__name__} keeps state per fragment that "
                        "cannot be joined into the whole matrix's, so a checkpoint cannot hold it (each TP rank's "
                        "would overwrite the others'). Use lightning_matrixfsdp.Muon, Shampoo or SOAP (whole-matrix "
                        "steps) or an elementwise optimizer for TP-split matrices, or keep this parameter replicated "
                        "in the parallelize plan")


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
        split_now = e.tp is not None
        if self.whole(key) or not (split_now or key in self.saved_split):
            return False
        if tuple(shape) == tuple(e.shape):
            return split_now
        if len(shape) == 0:
            return False
        where = (f"split along dim {e.tp.dim} here" if split_now else "split over tensor parallelism at the save")
        raise CheckpointMismatchError(
            f"{self.what}: optimizer state {name!r} of {key!r} has the shape {tuple(shape)}, but {key!r} is "
            f"{where} (global shape {tuple(e.shape)}) and {type(self.optimizer).__name__} keeps that state sliced "
            "like the parameter, so each of its tensors must have the global shape (or be a scalar). It was written "
            "by another optimizer or per fragment; restore it with the optimizer and mesh that saved it, or load "
            "the weights only (load_weights) and restart the optimizer state")

    def dcp_buffer(self, key: str, name: str, m: Any) -> Any:
        """What DCP loads saved state entry ``m`` (storage metadata) of ``key`` into: this TP rank's
        fragment (a DTensor) of fragment state, else a CPU tensor of the saved size (None: object)."""
        size = getattr(m, "size", None)
        if size is not None and self._sliced(key, name, tuple(size)):
            return self.index.fragment_request(key, m.properties.dtype)
        return placeholder(m)

    def from_file(self, key: str, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of ``key``'s whole saved state (a consolidated file): fragments
        copied out of fragment state, whole tensors copied."""
        out = {}
        for name, v in state.items():
            if isinstance(v, torch.Tensor):
                v = (self.index.narrow(key, v) if self._sliced(key, name, tuple(v.shape)) else v).clone()
            out[name] = v
        return out


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
