"""``full_model``: the whole model on one rank (or on every rank), as a plain module, for a while.

Sampling in a hook, exporting, pickling: things that need every weight in one process.
Every rank of the shard group enters the context (it is collective). The owners send
their weights to the chosen rank, which then holds a plain ``nn.Module``: every parameter
full (the same ``nn.Parameter`` objects, with the whole tensor as their data), no runtime
hook, no placement mark, no runtime state. A forward there runs locally, as on one device,
and ``torch.save(model)`` or ``copy.deepcopy(model)`` work. The other ranks keep their
empty placeholders, and a forward there raises at once. On exit the chosen rank drops
what it received and the model is sharded again, locally (no communication), so an
exception inside on one rank does not strand the others.

The weights are the resident ones, in their own dtype (a ``param_dtype`` applies to
training's materializations, not here). Changes made inside are not sent back to the
owners: use the context to read the model.

With tensor parallelism the chosen rank gets every TP-split parameter whole too (its T
fragments, from the owner's TP group, concatenated: ``tp/whole_comm``), as plain tensors
of the global shape, and the forward hooks ``parallelize_module`` installed (the parallel
styles' conversions of inputs and outputs to and from DTensors, which would talk to the
other TP ranks) are taken off the model there until the block ends: the model runs there
as the unsplit model. A plan that also changed module attributes for the fragments (a
per-rank head count, say) must set them back inside the block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.comm.p2p import gather_whole
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.tags import (
    attach_state,
    detach_state,
    retag_tp,
    pipelines_in,
    sharded_roots,
    state_of,
    tag_param,
    untag_param,
    untag_tp,
)
from lightning_matrixfsdp.runtime.tp.layout import TPLayout
from lightning_matrixfsdp.runtime.tp.whole_comm import Fragments, fragment_sources, gather_fragments


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_idle(state: MatrixFSDPState) -> None:
    if state.schedule.in_backward or any(u.in_forward for u in state.units):
        raise RuntimeError(
            "lightning_matrixfsdp.full_model(...) was entered during a forward or backward of the sharded model; "
            "enter it between steps (in a hook, or outside the training loop), on every rank")


def _from_torch_tp(hook: object) -> bool:
    """A hook ``torch.distributed.tensor`` registered: a parallel style's input or output conversion."""
    return str(getattr(hook, "__module__", None) or "").startswith("torch.distributed.tensor")


def _tp_hooks_off(root: nn.Module) -> list[tuple[dict, dict]]:
    """Take the TP plan's forward hooks off every module of ``root``: (hook dict, its entries before)."""
    saved = []
    for m in root.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            tp = [k for k, h in hooks.items() if _from_torch_tp(h)]
            if tp:
                saved.append((hooks, dict(hooks)))
                for k in tp:
                    del hooks[k]
    return saved


def _tp_hooks_on(saved: list[tuple[dict, dict]]) -> None:
    """Put them back in their order (hooks added inside the block stay, after them)."""
    for hooks, before in saved:
        added = {k: h for k, h in hooks.items() if k not in before}
        hooks.clear()
        hooks.update(before)
        hooks.update(added)


class _Whole:
    """One sharded root made a plain module on this rank until ``release``."""

    def __init__(self, root: nn.Module, state: MatrixFSDPState, received: dict[int, torch.Tensor]) -> None:
        self.root, self.state = root, state
        self.params: list[ShardedParam] = state.params
        self.placeholders: dict[int, torch.Tensor] = {}
        for i, full in received.items():
            p = self.params[i].resident
            self.placeholders[i] = p.data
            p.data = full
        for sp in self.params:
            untag_param(sp.resident)
        self.tp_marks = [untag_tp(sp.resident) for sp in self.params]
        state.remove_hooks()
        detach_state(root)
        self.tp_hooks = _tp_hooks_off(root) if state.mesh.tp_size > 1 else []

    def release(self) -> None:
        _tp_hooks_on(self.tp_hooks)
        attach_state(self.root, self.state)
        for i, sp in enumerate(self.params):
            if i in self.placeholders:
                sp.resident.data = self.placeholders[i]
            tag_param(sp.resident, sp.shard, sp.owned)
            retag_tp(sp.resident, self.tp_marks[i])
        self.state.install_hooks()


class _Elsewhere:
    """One sharded root whose whole model is on another rank: forwards here are refused."""

    def __init__(self, state: MatrixFSDPState, rank: int) -> None:
        self.state = state
        state.schedule.full_on = rank

    def release(self) -> None:
        self.state.schedule.full_on = None


def _split_params(st: MatrixFSDPState) -> dict[int, TPLayout]:
    """{index in ``st.params``: TP layout} of the parameters tensor parallelism splits."""
    layouts = st.tp_plan.layouts if st.tp_plan is not None else {}
    out = {}
    for i, sp in enumerate(st.params):
        lay = layouts.get(sp.shard.fqn)
        if lay is not None and lay.split:
            out[i] = lay
    return out


def _gather_split(st: MatrixFSDPState, split: dict[int, TPLayout], targets: list[int]) -> dict[int, torch.Tensor]:
    """The whole tensors of the TP-split parameters on ``targets`` (global ranks). Collective."""
    params = st.params
    held = {params[i].shard.fqn: st.mesh.tp_rank for i in split if params[i].owned}
    sources = fragment_sources(held, st.mesh.tp_size)
    idx = sorted(split)
    items = []
    for i in idx:
        lay, fqn = split[i], params[i].shard.fqn
        src = sources.get(fqn)
        if src is None or None in src:  # agreed: the same on every rank
            raise RuntimeError(f"full_model: no rank holds some TP fragment of {fqn!r} ({src}); the model's "
                               "tensor-parallel groups are not complete")
        items.append(Fragments(tuple(src), tuple(tuple(lay.local_shape(t)) for t in range(len(lay.sizes))),
                               lay.dim, params[i].orig_dtype))
    local = [params[i].resident.data if params[i].owned else None for i in idx]
    got = gather_fragments(items, local, targets, st.mesh.device, st.stats, "full_model",
                           "full_model: the TP fragments of the owners' weights")
    return {idx[j]: t for j, t in got.items()}


@contextmanager
def full_model(module: nn.Module, rank: Optional[int] = 0) -> Iterator[nn.Module]:
    """Gather the whole of the sharded ``module`` on global rank ``rank`` for the ``with`` block.

    Every rank enters it (it is collective over each shard group); inside, ``rank`` holds
    ``module`` as a plain module with every weight (run it there, under
    ``if trainer.global_rank == rank:``), and the other ranks keep their empty placeholders.
    ``rank=None`` gives every rank the whole model. The block runs under ``torch.no_grad()``;
    changes to the weights are not sent back. Under HSDP the shard group holding ``rank``
    gathers, the others keep their placeholders. On a model that is not sharded (DDP, one
    device) it does nothing, so the same code runs under every strategy. With tensor
    parallelism every TP-split weight arrives whole and the TP plan's forward hooks are off on
    ``rank`` inside (the unsplit model, run locally). Yields ``module``.
    """
    if pipelines_in(module):  # the same on every rank: refused before any communication
        raise MatrixShardError("full_model cannot gather a model split into pipeline stages: each rank holds its "
                               "stages only, and the pipelined model's forward runs through the schedule; save a "
                               "checkpoint (it keeps the whole model's names) and load or consolidate it into the "
                               "unsplit model (docs/pipeline-parallel.md)")
    roots = sharded_roots(module)
    if not roots:
        with torch.no_grad():
            yield module
        return
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < _world()):
        raise ValueError(f"full_model(rank={rank!r}): expected a global rank in [0, {_world()}) or None")
    states = [state_of(r) for r in roots]
    for st in states:
        _check_idle(st)
        if st.experts is not None:  # the same on every rank: refused before any communication
            raise MatrixShardError("full_model does not gather the local experts of expert_parallel_size > 1 yet "
                                   "(each rank would see only its own); save a consolidated checkpoint "
                                   "(save_sharded(..., full=True)) and load it into the unsharded model instead")
    held: list = []
    try:
        for root, st in zip(roots, states):
            st.settle_replicas()  # replica_split: every replica's weights current
            st.release_all()  # a unit left materialized (a forward without backward) is resharded
            targets = list(st.sg.global_ranks) if rank is None else [r for r in st.sg.global_ranks if r == rank]
            split = _split_params(st)
            plain = [i for i in range(len(st.params)) if i not in split]
            got = gather_whole([st.params[i] for i in plain], st.sg, st.stats, targets)
            received = {plain[j]: t for j, t in got.items()}
            if split:  # TP-split: the T fragments from the owner's TP group, on every target of the world
                received.update(_gather_split(st, split, list(range(_world())) if rank is None else [rank]))
            mine = st.sg.g(st.sg.rank)
            held.append(_Whole(root, st, received) if mine in targets else _Elsewhere(st, rank))  # type: ignore[arg-type]
        with torch.no_grad():
            yield module
    finally:
        for h in reversed(held):
            h.release()
