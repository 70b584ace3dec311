"""Model and optimizer state dicts of an owner-sharded module, sharded (for DCP) or full (on rank 0).

Sharded: each rank returns what it owns (and the replicated tensors), keyed by name,
so DCP writes every tensor once. Full: the owners stream their tensors to rank 0 one
at a time (bounded accelerator memory); rank 0 keeps them on the CPU.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_matrixfsdp.checkpoint.agree import agree, all_gather_object, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointError
from lightning_matrixfsdp.checkpoint.formats import hparams, to_native, unwrap_optimizer
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.optimizer_state import whole_state
from lightning_matrixfsdp.runtime.comm import comm_device
from lightning_matrixfsdp.runtime.p2p_comm import recv_tensor, send_tensor

__all__ = ["full_groups", "refuse_full_tp", "sharded_model_state_dict", "sharded_optimizer_state_dict", "to_rank0"]


def sharded_model_state_dict(module: nn.Module, full: bool = False, index: Optional[KeyIndex] = None
                             ) -> dict[str, Any]:
    """``full=False``: this rank's owned and replicated tensors (for DCP).  ``full=True``: the whole
    state on rank 0 (CPU), streamed from the owners one tensor at a time; ``{}`` elsewhere.
    Collective when ``full=True``: call it on every rank. ``index``: the save's key index."""
    index = index if index is not None else build_index(module)
    refuse_full_tp(index, full)
    if not full:
        out: dict[str, Any] = {k: index.as_saved(k, e.local) for k, e in index.entries.items()
                               if e.primary == k and e.local is not None}
        out.update(index.extra)
        return out
    rank = world()[0]
    device = comm_device()
    got: dict[str, torch.Tensor] = {}
    for key, e in index.entries.items():
        if e.primary != key:
            continue
        if e.owner is None:
            t = e.local.cpu() if rank == 0 and e.local is not None else None
        else:
            t = to_rank0(e.local, e.shape, e.dtype, e.owner_global, index.in_group0, device)
        if rank == 0:
            got[key] = t  # type: ignore[assignment]
    if rank != 0:
        return {}
    return {k: (got[index.entries[k].primary] if k in index.entries else index.extra[k]) for k in index.order}


def refuse_full_tp(index: KeyIndex, full: bool) -> None:
    """The consolidated (one-file) save of a tensor-parallel model is not built yet: refuse it
    alike on every rank (the TP size is the same everywhere)."""
    if full and index.tp_size > 1:
        raise CheckpointError(
            f"a consolidated (single-file) checkpoint of a tensor-parallel model (tensor_parallel_size="
            f"{index.tp_size}) is not supported yet; save a distributed checkpoint (a directory) instead")


def to_rank0(local: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, src: Optional[int],
              in_group0: bool, device: torch.device) -> Optional[torch.Tensor]:
    """Move one tensor from its owner ``src`` (a global rank) to rank 0's CPU; bounded memory."""
    rank = world()[0]
    if not in_group0 or src is None:
        return None
    if src == rank:
        assert local is not None
        if rank == 0:
            return local.cpu()
        send_tensor(local.to(device).contiguous(), dst=0)
        return None
    if rank == 0:
        return recv_tensor(torch.empty(tuple(shape), dtype=dtype, device=device), src=src).cpu()
    return None


def full_groups(index: KeyIndex, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every param group's keys over all ranks (routing left each rank its owned ones), in model order."""
    local = agree(lambda: [[index.key(p) for p in g["params"]] for g in optimizer.param_groups])
    merged: list[set[str]] = [set() for _ in local]
    for groups in all_gather_object(local):
        if len(groups) != len(merged):
            raise CheckpointError("ranks disagree on the number of optimizer param groups")
        for s, g in zip(merged, groups):
            s.update(g)
    return [sorted(s, key=index.order.__getitem__) for s in merged]


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool = False,
                                 index: Optional[KeyIndex] = None) -> dict[str, Any]:
    """Optimizer state keyed by parameter fqn (``full=False``, this rank's params, for DCP) or
    torch's native id-keyed format on rank 0 (``full=True``, with ``param_names``).  Collective.
    ``index``: the save's key index."""
    optimizer = unwrap_optimizer(optimizer)
    index = index if index is not None else build_index(module)
    refuse_full_tp(index, full)
    groups = full_groups(index, optimizer)
    if not full:
        state = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                key = index.key(p)
                if p in optimizer.state and index.steps(key):  # TP fragments of the state: chunks of the whole
                    whole = whole_state(index, optimizer, key)  # Shampoo's, SOAP's on the TP stepper: written whole
                    state[key] = {n: ((v.detach() if whole else index.as_saved(key, v.detach()))
                                      if isinstance(v, torch.Tensor) else v) for n, v in optimizer.state[p].items()}
        return {"state": state,
                "param_groups": [{**hparams(g), "params": list(f)} for g, f in zip(optimizer.param_groups, groups)]}
    rank = world()[0]
    params_of: dict[str, torch.Tensor] = {}
    desc: dict[str, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            key = index.key(p)
            e = index.entries[key]
            mine = index.steps(key) if e.owner is not None else rank == 0
            if mine and p in optimizer.state:
                params_of[key] = p
                desc[key] = {n: ("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("o", v)
                             for n, v in optimizer.state[p].items()}
    # Each key from the first rank of global rank 0's shard group that holds it; under
    # replica_split only the stepping replica holds it, which may be another group.
    sources: dict[str, tuple[int, dict[str, Any]]] = {}
    for r, in0, d in sorted(all_gather_object((rank, index.in_group0, desc)), key=lambda t: (not t[1], t[0])):
        for key, s in d.items():
            if key not in sources:
                sources[key] = (r, s)
    device = comm_device()
    state: dict[str, dict[str, Any]] = {}
    for key in sorted(sources, key=index.order.__getitem__):
        src, s = sources[key]
        for name, item in s.items():
            if item[0] == "o":
                value = item[1]
            else:
                local = optimizer.state[params_of[key]][name] if src == rank else None
                value = to_rank0(local, item[1], item[2], src, True, device)  # src: agreed by every rank
            if rank == 0:
                state.setdefault(key, {})[name] = value
    if rank != 0:
        return {}
    return to_native(state, [hparams(g) for g in optimizer.param_groups], groups)
