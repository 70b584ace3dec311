"""Model and optimizer state dicts of an owner-sharded module, sharded (for DCP) or full (on rank 0).

Sharded: each rank returns what it owns (and the replicated tensors), keyed by name,
so DCP writes every tensor once. Full: the owners stream their tensors to rank 0 one
at a time (bounded accelerator memory); rank 0 keeps them on the CPU. With tensor
parallelism a split tensor reaches rank 0 as its T fragments, concatenated there, so
the full state dict is the one the unsplit model would give: whole weights, fragment
state (Muon's momentum, AdamW's moments of split tails) assembled, whole-matrix state
(Shampoo, SOAP) as the TP stepper holds it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_matrixfsdp.checkpoint.agree import agree, all_gather_object, current_group, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointError
from lightning_matrixfsdp.checkpoint.formats import hparams, to_native, unwrap_optimizer
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.optimizer_state import check_joinable, expert_state_layout, state_as_saved
from lightning_matrixfsdp.runtime.comm.core import comm_device
from lightning_matrixfsdp.runtime.comm.p2p import recv_tensor, send_tensor
from lightning_matrixfsdp.runtime.tp.whole_comm import Fragments, fragment_sources, gather_fragments
from lightning_matrixfsdp.runtime.views.checkpoint import Chunked, Owned, Replicated, TPFragment

__all__ = ["fragments_to_rank0", "full_groups", "sharded_model_state_dict", "sharded_optimizer_state_dict",
           "stages_to_rank0", "to_rank0", "tp_sources"]


def sharded_model_state_dict(module: nn.Module, full: bool = False, index: Optional[KeyIndex] = None
                             ) -> dict[str, Any]:
    """``full=False``: this rank's owned and replicated tensors (for DCP).  ``full=True``: the whole
    state on rank 0 (CPU), streamed from the owners one tensor at a time; ``{}`` elsewhere.
    Collective when ``full=True``: call it on every rank. ``index``: the save's key index."""
    index = index if index is not None else build_index(module)
    if not full:
        out: dict[str, Any] = {k: index.as_saved(k, e.local) for k, e in index.entries.items()
                               if e.primary == k and e.local is not None}
        out.update(index.extra)
        return out
    if index.pp_size > 1:
        return stages_to_rank0(index)
    rank = world()[0]
    device = comm_device()
    sources = tp_sources(index)
    got: dict[str, torch.Tensor] = {}
    for key, e in index.entries.items():
        if e.primary != key:
            continue
        h = e.holding
        if isinstance(h, Chunked):  # TP-split or experts: its chunks, from the lowest ranks holding them
            t = fragments_to_rank0(index, key, e.local, sources.get(key), e.dtype, device)
        elif isinstance(h, Owned):
            t = to_rank0(e.local, e.shape, e.dtype, h.owner_global, index.in_group0, device)
        else:  # replicated
            t = e.local.cpu() if rank == 0 and e.local is not None else None
        if rank == 0:
            got[key] = t  # type: ignore[assignment]
    if rank != 0:
        return {}
    return {k: (got[index.entries[k].primary] if k in index.entries else index.extra[k]) for k in index.order}


def stages_to_rank0(index: KeyIndex, keys: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Pipeline parallelism: the whole model state (every stage's tensors, ``keys`` or all, in model
    order) on rank 0's CPU, each tensor sent by the lowest rank that holds it; ``{}`` elsewhere.
    Collective. Tensors held in chunks (tensor or expert parallelism) are refused on every rank."""
    rank = world()[0]
    device = comm_device()
    keys = list(keys) if keys is not None else index.all_keys()
    chunked = [k for k in keys if (k in index.entries and index.entries[k].chunk is not None)
               or (k in index.remote and index.remote[k].layout is not None)]
    if chunked:  # the same verdict on every rank: the index is joined over the stages
        raise CheckpointError(f"a consolidated checkpoint under pipeline parallelism cannot join tensors held in "
                              f"chunks yet ({chunked[0]!r}: tensor or expert parallelism); save a directory "
                              "(sharded) checkpoint and consolidate it offline (python -m lightning_matrixfsdp."
                              "consolidate)")
    got: dict[str, Any] = {}
    for key in keys:
        e, r = index.entries.get(key), index.remote.get(key)
        if e is None and r is None:
            got[key] = index.extra.get(key, index.remote_extra.get(key))
            continue
        primary = e.primary if e is not None else r.primary  # type: ignore[union-attr]
        if primary != key:
            continue
        src = index.senders[key]
        local = e.local if e is not None and src == rank else None
        shape, dtype = (e.shape, e.dtype) if e is not None else (r.shape, r.dtype)  # type: ignore[union-attr]
        t = to_rank0(local, shape, dtype, src, True, device)
        if rank == 0:
            got[key] = t
    if rank != 0:
        return {}
    primary_of = {k: (index.entries[k].primary if k in index.entries else index.remote[k].primary)
                  for k in keys if k in index.entries or k in index.remote}
    return {k: got[primary_of[k]] if k in primary_of else got[k] for k in keys}


def tp_sources(index: KeyIndex) -> dict[str, list[Optional[int]]]:
    """For every TP-split key: the global rank that sends each TP fragment of its weight to rank 0
    (the same answer on every rank). ``{}`` without tensor parallelism. Collective under TP."""
    # expert stacks under expert parallelism: chunk t from the first expert-parallel group's rank t (known)
    experts = {k: list(e.experts.writers) for k, e in index.entries.items() if e.primary == k and e.experts is not None}
    if index.tp_size == 1:
        return experts
    held = {k: index.tp_rank for k, e in index.entries.items()
            if e.primary == k and isinstance(e.holding, TPFragment) and e.local is not None}
    return {**fragment_sources(held, index.tp_size, current_group()), **experts}


def fragments_to_rank0(index: KeyIndex, key: str, local: Optional[torch.Tensor], sources: Optional[Sequence],
                       dtype: torch.dtype, device: torch.device, layout: Any = None) -> Optional[torch.Tensor]:
    """The whole tensor of TP-split ``key`` (its weight, or a state tensor of its fragment's shape)
    on rank 0's CPU: fragment t from global rank ``sources[t]`` (agreed), concatenated along the
    split dimension; None elsewhere. ``local``: this rank's fragment where it is a source.
    ``layout``: the split of a state tensor of another shape (an expert stack's), else the key's."""
    chunk = index.entries[index.entries[key].primary].chunk
    lay = layout if layout is not None else chunk.layout if chunk is not None else None
    if sources is None or None in sources:  # the same verdict on every rank: the sources are agreed
        missing = [t for t, s in enumerate(sources or []) if s is None] or "any"
        raise CheckpointError(f"{key!r}: no rank holds TP fragment(s) {missing} "
                              "of it; the tensor-parallel groups do not hold the whole tensor, so it cannot be "
                              "written whole")
    item = Fragments(tuple(sources), tuple(tuple(lay.local_shape(t)) for t in range(len(lay.sizes))), lay.dim, dtype)
    got = gather_fragments([item], [local if world()[0] in item.sources else None], [0], device,
                           what=f"the consolidated checkpoint's TP fragments of {key!r}")
    return got[0].cpu() if 0 in got else None


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
    return [sorted(s, key=index.position) for s in merged]  # pipeline: every stage's keys, in model order


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool = False,
                                 index: Optional[KeyIndex] = None) -> dict[str, Any]:
    """Optimizer state keyed by parameter fqn (``full=False``, this rank's params, for DCP) or
    torch's native id-keyed format on rank 0 (``full=True``, with ``param_names``).  Collective.
    ``index``: the save's key index."""
    optimizer = unwrap_optimizer(optimizer)
    index = index if index is not None else build_index(module)
    groups = full_groups(index, optimizer)
    if index.tp_size > 1 or any(e.experts is not None for e in index.entries.values()):  # TP or expert chunks:
        agree(check_joinable, index, optimizer)  # per-fragment state a whole tensor cannot hold, refused everywhere
    if not full:
        state = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                key = index.key(p)
                if p in optimizer.state and index.steps(key):  # TP fragments of the state: chunks of the whole
                    # (Shampoo's, SOAP's on the TP stepper: written whole; an expert stack's: chunks by expert)
                    state[key] = {n: (state_as_saved(index, optimizer, key, v.detach())
                                      if isinstance(v, torch.Tensor) else v) for n, v in optimizer.state[p].items()}
        return {"state": state,
                "param_groups": [{**hparams(g), "params": list(f)} for g, f in zip(optimizer.param_groups, groups)]}
    rank = world()[0]
    params_of: dict[str, torch.Tensor] = {}
    desc: dict[str, tuple[Optional[int], dict[str, Any]]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            key = index.key(p)
            e = index.entries[key]
            mine = index.steps(key) if not isinstance(e.holding, Replicated) else rank == 0
            if mine and p in optimizer.state:
                params_of[key] = p
                desc[key] = (index.part(key) if e.chunk is not None else None,
                             {n: ("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("o", v)
                              for n, v in optimizer.state[p].items()})
    # Each key (each TP fragment of a split one) from the first rank of global rank 0's shard
    # group that holds it; under replica_split only the stepping replica holds it, which may be
    # another group.
    holders: dict[str, dict[Optional[int], tuple[int, dict[str, Any]]]] = {}
    for r, in0, d in sorted(all_gather_object((rank, index.in_group0, desc)), key=lambda t: (not t[1], t[0])):
        for key, (t, s) in d.items():
            holders.setdefault(key, {}).setdefault(t, (r, s))
    device = comm_device()
    state: dict[str, dict[str, Any]] = {}
    for key in sorted(holders, key=index.position):  # pipeline: every stage's keys, in model order
        for name, how in _state_plan(index, key, holders[key]):
            if how[0] == "o":
                value = how[1]
            elif how[0] == "t":
                src = how[1]
                local = optimizer.state[params_of[key]][name] if src == rank else None
                value = to_rank0(local, how[2], how[3], src, True, device)  # src: agreed by every rank
            else:
                local = optimizer.state[params_of[key]][name] if rank in how[1] else None
                value = fragments_to_rank0(index, key, local, how[1], how[2], device, *how[3:])
            if rank == 0:
                state.setdefault(key, {})[name] = value
    if rank != 0:
        return {}
    return to_native(state, [hparams(g) for g in optimizer.param_groups], groups)


def _state_plan(index: KeyIndex, key: str, holders: dict[Optional[int], tuple[int, dict[str, Any]]]
                ) -> list[tuple[str, tuple]]:
    """How each state entry of ``key`` reaches rank 0, from ``holders`` ({TP rank or None: (global
    rank, {name: spec})}, the same on every rank): ``("o", value)``, ``("t", src, shape, dtype)``
    (one rank's tensor as it is) or ``("f", sources, dtype)`` (TP fragments, concatenated).

    A TP-split key's state is either *fragment state*, held by every TP rank (Muon's momentum,
    AdamW's moments: tensors of the fragment's shape are concatenated, the others, such as a
    step count, are the same on every TP rank and taken from TP rank 0), or *whole-matrix
    state*, held by the matrix's TP stepper alone (Shampoo, SOAP: taken as it is)."""
    e = index.entries[index.entries[key].primary] if key in index.entries else None  # None: another stage's
    chunk = e.chunk if e is not None else None
    if None in holders or chunk is None:
        src, spec = holders[None]
        return [(n, item if item[0] == "o" else ("t", src, item[1], item[2])) for n, item in spec.items()]
    lay, size = chunk.layout, len(chunk.layout.sizes)
    tp_stepper = chunk.tp_stepper if isinstance(chunk, TPFragment) else None  # expert chunks: none
    if set(holders) == {tp_stepper} and size > 1:
        src, spec = holders[tp_stepper]
        return [(n, item if item[0] == "o" else ("t", src, item[1], item[2])) for n, item in spec.items()]
    if set(holders) != set(range(size)):
        raise CheckpointError(
            f"the optimizer state of {key!r} is held by TP rank(s) {sorted(holders)} of {size}: neither every TP "
            "rank's fragment state nor the TP stepper's whole-matrix state; it cannot be written whole")
    specs = [holders[t][1] for t in range(size)]
    out: list[tuple[str, tuple]] = []
    for name, item in specs[0].items():
        items = [s.get(name) for s in specs]
        per_expert = (expert_state_layout(index, key, (lay.global_shape[0], *item[1][1:]), local=False)
                      if item[0] == "t" and e.experts is not None and len(item[1]) else None)
        if item[0] == "o":
            out.append((name, item))
        elif per_expert is not None and all(  # an expert stack's state: each rank's experts, by expert
                i is not None and i[0] == "t" and (i[1][0], *i[1][1:]) == (lay.sizes[t], *item[1][1:])
                for t, i in enumerate(items)):
            out.append((name, ("f", tuple(holders[t][0] for t in range(size)), item[2], per_expert)))
        elif all(i is not None and i[0] == "t" and tuple(i[1]) == tuple(lay.local_shape(t))
                 for t, i in enumerate(items)):
            out.append((name, ("f", tuple(holders[t][0] for t in range(size)), item[2])))
        elif all(i is not None and i[0] == "t" and tuple(i[1]) == tuple(item[1]) for i in items):
            out.append((name, ("t", holders[0][0], item[1], item[2])))  # the same on every TP rank
        else:
            raise CheckpointError(f"the optimizer state {name!r} of {key!r} has the shapes "
                                  f"{[None if i is None else i[1] for i in items]} on the TP ranks: neither "
                                  "fragments of the parameter's split nor one tensor every TP rank holds")
    return out
