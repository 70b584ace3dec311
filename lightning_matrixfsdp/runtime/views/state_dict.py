"""``model.state_dict()`` of a sharded model: whole tensors, or an error that says what to use.

Between steps a rank holds only part of the model: empty placeholders of the roles other
ranks own, with tensor parallelism its TP fragments, with expert parallelism its own experts
of each stack, its block of a stack the planner split (``views/residency.py`` lists them). A plain
``state_dict()`` of that looks whole but is not: ``if trainer.is_global_zero:
torch.save(model.state_dict(), path)`` would write a file missing weights. Whole tensors need
the other ranks, and ``state_dict()`` is often called on one rank alone, where a collective
would hang; so the call is refused wherever some parameter is not whole on this rank, by one
rule (``residency.is_whole``: the resident shape is the whole shape the parameter's marks
record), naming what gives whole weights instead. The same rule runs on the sharded root's
``state_dict`` and on every submodule holding parameters (``model.model.state_dict()`` of a
LightningModule's inner model, or Hugging Face's ``save_pretrained``, which calls it).

It passes, unchanged:

* where this rank holds every parameter whole (one rank per shard group, no TP split, no
  expert parallelism);
* inside ``full_model`` on the rank that holds the whole model (the hooks are off there);
* inside ``local_state_dict``: this rank's own tensors and placeholders, on purpose (the
  checkpoint code's key index reads them so; a sharded copy's ``state_dict`` never meets
  the hooks, they stay with the model).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from lightning_matrixfsdp.runtime.views.residency import EXPERT_SLICE, PartialTensor, partial_tensors
from lightning_matrixfsdp.runtime.tags import state_of

__all__ = ["PartialStateDictError", "local_state_dict", "local_views", "refuse_partial_part",
           "refuse_partial_state_dict"]

_LOCAL = threading.local()  # per thread: a background checkpoint thread does not open the main one's door


class PartialStateDictError(RuntimeError):
    """``state_dict()`` of a sharded model where this rank holds only part of it."""


@contextmanager
def local_views() -> Iterator[None]:
    """Inside, ``state_dict()`` of a sharded model gives this rank's tensors and placeholders."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


def local_state_dict(module: nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """``module.state_dict()`` as this rank holds it: the whole tensor of what it owns, an empty
    placeholder ``(0, *shape[1:])`` elsewhere (with tensor parallelism, this TP rank's fragment).
    Local (no communication). For whole weights use ``full_model`` or a checkpoint."""
    with local_views():
        return module.state_dict(keep_vars=keep_vars)


def _summary(partial: list[PartialTensor], prefix: str) -> str:
    """'N empty placeholders, e.g. ...; M expert-parallel slices, e.g. ...' (kinds in first-seen order)."""
    kinds: dict[str, list[PartialTensor]] = {}
    for t in partial:
        kinds.setdefault(t.kind, []).append(t)
    parts = []
    for kind, ts in kinds.items():
        t = ts[0]
        detail = f", {t.detail}" if t.detail else ""
        parts.append(f"{len(ts)} {kind}{'s' if len(ts) > 1 else ''}, e.g. {prefix}{t.name} of shape {t.shape} "
                     f"(whole: {t.whole}{detail})")
    return "; ".join(parts)


def _instead(st: Any, partial: list[PartialTensor]) -> str:
    """What gives whole weights: ``full_model`` where it can, checkpoints always."""
    files = ("`trainer.save_checkpoint(path)` with MatrixFSDPStrategy(save_distributed_checkpoint=False) (one file "
             "whose state_dict holds every weight whole) or the default directory format, "
             "`lightning_matrixfsdp.save_sharded(model, path, full=True)` outside the Trainer, and "
             "`python -m lightning_matrixfsdp.consolidate DIR FILE` for one file from a directory (add "
             "`--format safetensors` for Hugging Face)")
    mine = "For this rank's own tensors and placeholders on purpose: lightning_matrixfsdp.local_state_dict(model)."
    if st.experts is not None or any(t.kind == EXPERT_SLICE for t in partial):
        return (f"Instead, on every rank: {files}; full_model does not gather expert-parallel experts yet. {mine}")
    return ("Instead, on every rank: `with lightning_matrixfsdp.full_model(model): if trainer.is_global_zero: "
            f"torch.save(model.state_dict(), path)` (whole weights on rank 0); or {files}. {mine}")


def _refuse(st: Any, module: nn.Module, partial: list[PartialTensor], prefix: str, part: bool) -> None:
    total = sum(1 for _ in module.parameters(recurse=not part))
    where = ""
    if getattr(st.schedule, "full_on", None) is not None:
        where = f" (full_model holds the whole model on rank {st.schedule.full_on}, not here)"
    what = f"state_dict() of a matrix_fsdp-sharded model{where}"
    if part:
        path = next((n for n, m in st.root.named_modules() if m is module), "")
        what = f"state_dict() of {path!r} ({type(module).__name__}), part of a matrix_fsdp-sharded model{where},"
    here = f"shard rank {st.sg.rank} of {st.sg.size}"
    if st.experts is not None:
        here += f", expert-parallel rank {st.experts.groups.ep_rank} of {st.experts.groups.ep_size}"
    raise PartialStateDictError(
        f"{what} would be partial: this rank ({here}) holds {total - len(partial)} of {total} parameters "
        f"whole; the others are {_summary(partial, prefix)}; so a file saved from it would miss weights. "
        + _instead(st, partial))


def refuse_partial_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """The ``state_dict`` pre-hook of a sharded root (a plain function: a copy that inherits it
    has no state and passes)."""
    st = state_of(module)
    if st is None or getattr(_LOCAL, "depth", 0):
        return
    partial = partial_tensors(module)
    if partial:
        _refuse(st, module, partial, prefix, part=False)


def refuse_partial_part(st: Any, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """The ``state_dict`` pre-hook of a submodule holding parameters, as a method of the root's
    state ``st`` (``MatrixFSDPState.refuse_partial_part``: a copy of the model drops it with the
    runtime's other hooks, and a pickle meets the state's refusal): the same rule on the
    submodule's own parameters (its children have theirs)."""
    if getattr(_LOCAL, "depth", 0):
        return
    partial = partial_tensors(module, recurse=False)
    if partial:
        _refuse(st, module, partial, prefix, part=True)
