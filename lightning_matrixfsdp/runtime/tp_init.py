"""Meta-device initialization with tensor parallelism: whole tensors, initialized once.

Without tensor parallelism each owner runs ``reset_parameters`` on its whole tensors. With it,
an owner holds only its TP fragment, and running ``reset_parameters`` there would be wrong
twice: a rowwise-split ``nn.Linear`` would draw with the fragment's fan-in (bound
``1/sqrt(in/T)``, not ``1/sqrt(in)``), and each TP rank would draw its copy of a TP-replicated
parameter (a LayerNorm, a matrix the plan leaves whole) from its own generator, so the copies
would differ. Instead, module by module in ``modules()`` order, every rank runs the module's
``reset_parameters`` on whole tensors of the global shapes, put in place of the module's own
parameters for the call: the random numbers drawn are those of a one-process initialization
of the unsplit model under the same seed (each rank's generator advances as there, also where
it keeps nothing). Then TP rank 0 of each owner's TP group sends the other TP ranks their
slices (and the whole tensor of a replicated parameter: ``tp_init_comm``); the other ranks drop
what they drew. Memory: one module's parameters whole at a time.

``reset_parameters`` must initialize the module's own parameters only (torch's convention for
meta-device initialization): a parameter a parent's method writes is written to its resident
tensor, not to the whole one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.tp_init_comm import scatter_initialized

__all__ = ["init_tp_meta"]


def init_tp_meta(meta_modules: list[nn.Module], params: list[ShardedParam], tp_plan: Any, tp: Any,
                 device: torch.device, stats: Any = None) -> None:
    """Initialize the parameters of ``meta_modules`` (in this order, the same on every rank) as a
    one-process initialization of the unsplit model would, and give each owner its TP fragment.
    ``params``: every sharded parameter of the root (registered on the modules as residents);
    ``tp``: the TP group (``ShardGroup``). Collective over the TP group."""
    by_id = {id(sp.resident): sp for sp in params}
    for m in meta_modules:
        reset = getattr(m, "reset_parameters", None)
        own = [(name, by_id[id(p)]) for name, p in m._parameters.items() if p is not None and id(p) in by_id]
        if not callable(reset) or not own:
            continue
        saved = dict(m._parameters)
        whole: dict[str, torch.Tensor] = {}
        for name, sp in own:
            shape = tp_plan.layouts[sp.shard.fqn].global_shape
            whole[name] = torch.empty(shape, dtype=sp.orig_dtype, device=device)
            m._parameters[name] = nn.Parameter(whole[name], requires_grad=sp.resident.requires_grad)
        try:
            with torch.no_grad():
                reset()
        finally:
            m._parameters.update(saved)
        mine = [(name, sp) for name, sp in own if sp.owned]
        scatter_initialized(tp, [tp_plan.layouts[sp.shard.fqn] for _, sp in mine],
                            [whole[name] if tp.rank == 0 else None for name, sp in mine],
                            [sp.resident.data for _, sp in mine], stats)
