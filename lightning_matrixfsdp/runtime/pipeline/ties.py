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

The transfers go between the copies' *stepping* owners, paired in rank order. With HSDP inside
the stages each replica has an owner of each copy holding the replicas' mean gradient, and each
replica steps it: replica k's head owner sends to replica k's embedding owner, so every replica
sums and steps the same values. Under ``replica_split`` one replica steps each copy (the
embedding's and the head copy's stepping replicas may differ): the one holding the head copy's
gradient sends it to the one stepping the embedding, and the stepped value goes back to the head
copy's stepper; each stage's replica transfers (``sync_replicas``, or the adapters right after
the step) then carry both copies to the other replicas, so ``sync_weights`` must run before them.
Several stages per rank: the first and the last stage are on different ranks in loop order
(Interleaved1F1B, LoopedBFS); where one rank owns both copies (a V order) the sum is local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline.comm import PipelineMesh
from lightning_matrixfsdp.runtime.pipeline.ties_comm import gather_tie_flags, recv_from, send_to
from lightning_matrixfsdp.runtime.tags import is_owned, recipe_of, shard_of, state_of, tag_recipe

__all__ = ["Tie", "TiedCopies", "find_ties", "tie_pairs", "untie_for_last_stage"]


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
    (any schedule, any data-parallel layout inside the stages); anything else shared is refused,
    and so is a tie with one pipeline rank. ``per_rank`` (stages per rank) changes nothing here."""
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
    if ties and mesh.pp_size < 2:
        raise MatrixShardError(f"tied weights {ties[0].first} = {ties[0].last} across pipeline stages need "
                               "pipeline_parallel_size >= 2 (with one pipeline rank nothing is split across ranks: "
                               "train without pipeline parallelism), or untie them (Hugging Face: "
                               "tie_word_embeddings=False)")
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


def _steps_here(p: Optional[nn.Parameter], stages: Sequence[nn.Module]) -> bool:
    """Whether this rank steps ``p`` (a copy of a tied weight it holds, or None): it owns it and,
    under ``replica_split``, its replica is the stepping one of ``p``'s stage."""
    if p is None or not is_owned(p):
        return False
    shard = shard_of(p)
    for stage in stages:
        st = state_of(stage)
        if st is None or shard is None or all(q is not p for q in stage.parameters()):
            continue
        stepper = st.plan.stepper(shard.fqn)
        return stepper is None or stepper == st.replica_rank
    return True  # not sharded (a stage without a state): its holder steps it


def tie_pairs(flags: list[list[list[int]]], ties: list[Tie]) -> list[list[tuple[int, int]]]:
    """For each tie, the ``(embedding's stepping owner, head copy's stepping owner)`` global rank
    pairs, from every rank's ``(steps the first copy, steps the last copy)``: both lists in rank
    order (replica order), paired one to one. Refuses counts that cannot be paired."""
    pairs = []
    for i, tie in enumerate(ties):
        first = [r for r, rows in enumerate(flags) if rows[i][0]]
        last = [r for r, rows in enumerate(flags) if rows[i][1]]
        if not first or len(first) != len(last):
            raise MatrixShardError(f"tied weights {tie.first} = {tie.last}: the embedding is stepped on ranks {first} "
                                   f"and the head's copy on ranks {last}, which cannot be paired one to one; give the "
                                   "first and the last stage the same HSDP layout and the same replica_split")
        pairs.append(list(zip(first, last)))
    return pairs


class TiedCopies:
    """The tied weights of a pipeline as this rank sees them, and the two transfers that keep the
    copies one weight. Building it is collective over the world (every rank says which copies it steps)."""

    def __init__(self, ties: list[Tie], params: dict[str, nn.Parameter], mesh: PipelineMesh,
                 stages: Sequence[nn.Module] = ()) -> None:
        self.ties = ties
        self.first = [params.get(t.first) for t in ties]
        self.last = [params.get(t.last) for t in ties]
        flags = [(int(_steps_here(p, stages)), int(_steps_here(q, stages))) for p, q in zip(self.first, self.last)]
        self.rank = mesh.rank
        # this rank's pair of each tie (None: it steps neither copy)
        self.pairs = [next((pr for pr in prs if self.rank in pr), None) for prs in tie_pairs(gather_tie_flags(flags),
                                                                                               ties)]

    def reduce_grads(self) -> None:
        """Before ``optimizer.step()``: the head copy's gradient added to the embedding's, on its
        stepping owner(s); the head copy's gradient cleared. Collective between each pair of owners."""
        for first, last, pair in zip(self.first, self.last, self.pairs):
            if pair is None:
                continue
            r_first, r_last = pair
            g = None
            if self.rank == r_last:
                g = last.grad if last.grad is not None else torch.zeros_like(last)
                last.grad = None
                if r_first != r_last:
                    send_to(g, r_first)
            if self.rank == r_first:
                if r_first != r_last:
                    g = torch.empty_like(first)
                    recv_from(g, r_last)
                first.grad = g if first.grad is None else first.grad + g

    def sync_weights(self) -> None:
        """After ``optimizer.step()`` (and before the stages' replica transfers, under
        ``replica_split``): the embedding's new value to the head copy's stepping owner(s)."""
        with torch.no_grad():
            for first, last, pair in zip(self.first, self.last, self.pairs):
                if pair is None:
                    continue
                r_first, r_last = pair
                if r_first == r_last:
                    last.data.copy_(first.detach())
                elif self.rank == r_first:
                    send_to(first.detach(), r_last)
                elif self.rank == r_last:
                    recv_from(last.data, r_first)
