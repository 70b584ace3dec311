"""Tied embeddings across the first and the last pipeline stage (one weight used by the
embedding on stage 0 and by the head on the last stage).

The last stage gets its own copy of the weight (a new parameter with the same value and the
same Muon-recipe mark); each copy is owner-sharded in its own stage. Before the optimizer
steps, :meth:`TiedCopies.reduce_grads` sends the head copy's gradient from its owner to the
owner of the embedding, which adds it: the sum of both uses' gradients, as autograd gives the
one weight in the unsplit model. Only the embedding's owner steps it (the head copy's gradient
is cleared, so its optimizer skips it); :meth:`TiedCopies.sync_weights`, after the step, sends
the new value to the head copy's owner. Neither transfer is inside ``optimizer.step()``. The
sum is taken in another order than autograd's (all of one use's micro-batches, then the other's),
so a tied weight equals the unsplit model's up to float32 rounding, not bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline.comm import PipelineMesh, recv_from, send_to, tie_owners
from lightning_matrixfsdp.runtime.tags import is_owned, recipe_of, tag_recipe

__all__ = ["Tie", "TiedCopies", "find_ties", "untie_for_last_stage"]


@dataclass(frozen=True)
class Tie:
    """One weight shared by the first stage (``first``: its name there) and the last (``last``)."""

    first: str
    last: str


def _names_in(model: nn.Module, keep: list[str]) -> dict[int, str]:
    """id of each parameter under the modules ``keep`` -> its first global name there."""
    out: dict[int, str] = {}
    for n in keep:
        for pn, p in model.get_submodule(n).named_parameters(remove_duplicate=False):
            out.setdefault(id(p), f"{n}.{pn}")
    return out


def find_ties(model: nn.Module, keeps: list[list[str]], mesh: PipelineMesh, per_rank: int) -> list[Tie]:
    """Weights shared between stages, every one of them a tie of the first and the last stage
    that two ranks of plain data parallelism hold; anything else shared is refused."""
    held = [_names_in(model, k) for k in keeps]
    ties, last = [], len(keeps) - 1
    for pid, name in held[0].items():
        stages = [s for s in range(len(keeps)) if pid in held[s]]
        if stages == [0, last] and last > 0:
            ties.append(Tie(name, held[last][pid]))
    for s in range(1, last):
        for pid, name in held[s].items():
            others = [t for t in range(len(keeps)) if t != s and pid in held[t]]
            if others:
                raise MatrixShardError(f"parameter {name!r} is shared by pipeline stages {sorted([s, *others])}; "
                                       "only a weight tied between the first and the last stage is supported")
    if ties and (mesh.pp_size < 2 or per_rank > 1):
        raise MatrixShardError(f"tied weights {ties[0].first} = {ties[0].last} need the first and the last stage on "
                               "different ranks: one stage per rank (GPipe or 1F1B) and pipeline_parallel_size >= 2, or "
                               "untie them (Hugging Face: tie_word_embeddings=False)")
    if ties and getattr(mesh.dp_mesh, "ndim", 1) > 1:
        raise MatrixShardError(f"tied weights {ties[0].first} = {ties[0].last} across pipeline stages with HSDP inside "
                               "a stage are not supported yet; untie them (tie_word_embeddings=False) or leave "
                               "shard_size unset")
    return ties


def untie_for_last_stage(model: nn.Module, ties: list[Tie]) -> None:
    """On a rank that builds the last stage: the head gets its own copy of each tied weight."""
    for tie in ties:
        owner_name, leaf = tie.last.rsplit(".", 1)
        module = model.get_submodule(owner_name)
        shared = getattr(module, leaf)
        copy = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
        if recipe_of(shared) is not None:
            tag_recipe(copy, recipe_of(shared))
        setattr(module, leaf, copy)


class TiedCopies:
    """The tied weights of a pipeline as this rank sees them, and the two transfers that keep the
    copies one weight. Building it is collective (every rank says which copies it owns)."""

    def __init__(self, ties: list[Tie], params: dict[str, nn.Parameter], mesh: PipelineMesh) -> None:
        self.ties = ties
        self.first = [params.get(t.first) for t in ties]
        self.last = [params.get(t.last) for t in ties]
        flags = [(p is not None and is_owned(p), q is not None and is_owned(q)) for p, q in zip(self.first, self.last)]
        self.owners = tie_owners(flags)
        self.rank = mesh.rank

    def reduce_grads(self) -> None:
        """Before ``optimizer.step()``: the head copy's gradient added to the embedding's, on its owner;
        the head copy's gradient cleared. Collective between the two owners of each tie."""
        for first, last, (r_first, r_last) in zip(self.first, self.last, self.owners):
            if self.rank == r_last:
                g = last.grad if last.grad is not None else torch.zeros_like(last)
                send_to(g, r_first)
                last.grad = None
            elif self.rank == r_first:
                incoming = torch.empty_like(first)
                recv_from(incoming, r_last)
                first.grad = incoming if first.grad is None else first.grad + incoming

    def sync_weights(self) -> None:
        """After ``optimizer.step()``: the embedding's new value to the head copy's owner."""
        with torch.no_grad():
            for first, last, (r_first, r_last) in zip(self.first, self.last, self.owners):
                if self.rank == r_first:
                    send_to(first.detach(), r_last)
                elif self.rank == r_last:
                    recv_from(last.data, r_first)
