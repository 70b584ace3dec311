"""How many tokens each expert received: counted where the routing is already known, summarized for logs.

:class:`RoutingCounts` keeps, for every experts module (``expert_seams.ExpertSeam``), the number of
(token, slot) pairs the router sent to each expert since the last report, plus the slots it sent to
no expert (index ``E``, the value Hugging Face's expert loops skip: dropped or overflowed tokens).
It counts only training forwards (the module in training mode), never an activation-checkpoint
recomputation inside backward, and costs nothing that waits on the device:

- under expert parallelism the token dispatch has computed the counts already, on the host, for its
  counts exchange (``expert_dispatch.expert_parallel_forward``'s ``on_counts``): they are added;
- otherwise a forward pre-hook on the experts module counts its ``top_k_index`` (or GPT-OSS's
  ``router_indices``; a grouped experts module's ``num_tokens_per_expert``) with one ``bincount``
  on the device, added to a device tensor (no synchronization).

:func:`summarize` turns the whole world's counts (summed by ``queries.get_expert_stats``, one small
all-reduce at a log step) into metrics: per experts module the tokens of the least and the most
loaded expert per optimizer step and the coefficient of variation of the per-expert counts, the
worst coefficient over the modules, and the dropped slots where there are any.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from lightning_matrixfsdp.runtime.experts.seams import GROUPED, find_seams

__all__ = ["RoutingCounts", "summarize", "watch_routing"]

#: the argument of each seam kind's forward that holds the routing (second, after the hidden states)
_ROUTING_ARGS = ("top_k_index", "router_indices", "num_tokens_per_expert")


class RoutingCounts:
    """Per experts module, the tokens each expert received in training forwards since the last :meth:`take`."""

    def __init__(self) -> None:
        #: experts module name -> counts ``[E + 1]`` (int64; the last: slots routed to no expert)
        self.counts: dict[str, torch.Tensor] = {}
        self.num_experts: dict[str, int] = {}
        #: whether backward is running (a forward then is an activation-checkpoint recomputation)
        self.in_backward: Callable[[], bool] = lambda: False
        self._handles: list[Any] = []

    def add_module(self, fqn: str, num_experts: int) -> None:
        self.num_experts[fqn] = num_experts

    def recorder(self, fqn: str, module: nn.Module) -> Callable[[torch.Tensor], None]:
        """``on_counts(counts)`` for the expert-parallel dispatch of ``module``: its bincount ``[>= E]``
        of the top-k choices (index ``E``: no expert), added when the forward counts."""
        def record(counts: torch.Tensor) -> None:
            if module.training and not self.in_backward():
                self._add(fqn, counts)
        return record

    def watch(self, fqn: str, module: nn.Module, kind_grouped: bool) -> None:
        """Count ``module``'s routing argument in a forward pre-hook (no expert parallelism)."""
        e = self.num_experts[fqn]

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if not mod.training or self.in_backward():
                return
            routing = args[1] if len(args) > 1 else next((kwargs[n] for n in _ROUTING_ARGS if n in kwargs), None)
            if not isinstance(routing, torch.Tensor):
                return
            if kind_grouped:  # already the tokens per expert
                counts = torch.cat([routing.detach().reshape(-1).long(), routing.new_zeros(1, dtype=torch.long)])
            else:
                counts = torch.bincount(routing.detach().reshape(-1).long().clamp(0, e), minlength=e + 1)
            self._add(fqn, counts)
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _add(self, fqn: str, counts: torch.Tensor) -> None:
        e = self.num_experts[fqn]
        counts = counts[:e + 1]
        held = self.counts.get(fqn)
        if held is None:
            self.counts[fqn] = counts.to(torch.int64, copy=True)
        else:
            held.add_(counts.to(held.device, torch.int64))

    def take(self) -> tuple[list[str], list[int], torch.Tensor]:
        """(module names, their numbers of experts, every module's counts ``[E + 1]`` one after the
        other as one int64 host tensor) and start over; a module that counted nothing gives zeros.
        Local (it waits for the device's counts)."""
        names = list(self.num_experts)
        rows = []
        for fqn in names:
            held = self.counts.pop(fqn, None)
            rows.append(torch.zeros(self.num_experts[fqn] + 1, dtype=torch.int64) if held is None else held.cpu())
        flat = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        return names, [self.num_experts[f] for f in names], flat

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def watch_routing(root: nn.Module, routing: RoutingCounts) -> None:
    """Without expert parallelism: count the routing of every experts module under ``root`` in a
    forward pre-hook (one that does not pass the checks expert parallelism needs is left out)."""
    for seam in find_seams(root, strict=False):
        routing.add_module(seam.fqn, seam.num_experts)
        routing.watch(seam.fqn, seam.module, kind_grouped=seam.kind == GROUPED)


def _short_names(names: list[str]) -> list[str]:
    """The module names without the dotted prefix and suffix they all share (``model.layers.N.mlp.experts``
    -> ``N``); the full names where that leaves nothing or a name twice."""
    if len(names) < 2:
        return [n or "<root>" for n in names]
    parts = [n.split(".") for n in names]
    lo = 0
    while all(len(p) > lo + 1 for p in parts) and len({p[lo] for p in parts}) == 1:
        lo += 1
    hi = 0
    while all(len(p) > lo + hi + 1 for p in parts) and len({p[-1 - hi] for p in parts}) == 1:
        hi += 1
    short = [".".join(p[lo:len(p) - hi]) for p in parts]
    return short if all(short) and len(set(short)) == len(short) else names


def summarize(names: list[str], experts: list[int], flat: list[int], steps: int,
              prefix: str = "matrix_fsdp/experts/") -> dict[str, float]:
    """Metrics of the world's counts (``flat``: each module's ``[E + 1]`` one after the other, as
    :meth:`RoutingCounts.take` lays them out) over ``steps`` optimizer steps: per module
    ``tokens_min`` and ``tokens_max`` (the least and most loaded expert's tokens per step) and
    ``tokens_cv`` (standard deviation over mean of the per-expert counts; 0 is perfect balance);
    ``tokens_cv_max`` over the modules; ``dropped`` (slots routed to no expert, per step, all
    modules) only where there are any. Modules that received no token are left out."""
    out: dict[str, float] = {}
    worst, dropped, start = None, 0, 0
    per = max(steps, 1)
    for short, e in zip(_short_names(names), experts):
        tokens, drop = flat[start:start + e], flat[start + e]
        start += e + 1
        dropped += drop
        total = sum(tokens)
        if total == 0:
            continue
        mean = total / e
        cv = math.sqrt(sum((t - mean) ** 2 for t in tokens) / e) / mean
        out[f"{prefix}{short}/tokens_min"] = min(tokens) / per
        out[f"{prefix}{short}/tokens_max"] = max(tokens) / per
        out[f"{prefix}{short}/tokens_cv"] = cv
        worst = cv if worst is None else max(worst, cv)
    if worst is not None:
        out[f"{prefix}tokens_cv_max"] = worst
    if dropped:
        out[f"{prefix}dropped"] = dropped / per
    return out
