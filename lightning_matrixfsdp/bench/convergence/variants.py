"""The orthogonalizer variants the convergence benchmark trains with: a Muon
orthogonalizer by name, ``name@k`` for ``k`` iterations, and ``fast~<candidate>`` for
another fitted four-quintic schedule run with ``fast``'s kernels."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import orthogonalize_batched, orthogonalize_with

from .report import ORTHOGONALIZERS

__all__ = ["CANDIDATE_SCHEDULES", "candidate_muon", "parse_orthogonalizer"]

#: Other four-quintic schedules fitted like ``FAST_SCHEDULE`` (``scripts/fit_fast_schedule.py``
#: with other band limits and a weight on matching the default below 1e-3), run as
#: ``"fast~<name>"`` to compare them in training (docs/decisions.md, issue 15). The name is
#: the slope at 0 relative to the default's.
CANDIDATE_SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "slope083": ((5.230927, -14.897663, 10.623016), (4.641483, -8.675433, 4.079784),
                 (4.083947, -6.173584, 2.397376), (4.07533, -5.650123, 2.193497)),
    "slope099": ((5.304776, -15.135395, 10.80527), (4.643679, -8.380406, 3.794984),
                 (4.529153, -6.686324, 2.506685), (4.295174, -5.081765, 1.606076)),
}


def parse_orthogonalizer(name: str) -> tuple[str, int, str | None]:
    """``"newton_schulz@4"`` -> ``("newton_schulz", 4, None)``: a Muon orthogonalizer, its
    ``ns_steps`` (5 without ``@``) and, for ``"fast~<name>"``, a candidate of
    :data:`CANDIDATE_SCHEDULES` that replaces ``fast``'s schedule."""
    base, sep, steps = name.partition("@")
    base, tilde, candidate = base.partition("~")
    if (base not in ORTHOGONALIZERS or (sep and not steps.isdigit())
            or (tilde and (base != "fast" or candidate not in CANDIDATE_SCHEDULES))):
        raise argparse.ArgumentTypeError(
            f"orthogonalizer {name!r}: expected one of {', '.join(ORTHOGONALIZERS)}, optionally with "
            f"@<ns_steps>, or fast~<one of {', '.join(CANDIDATE_SCHEDULES)}>")
    return base, int(steps) if sep else 5, candidate or None


def candidate_muon(schedule: tuple[tuple[float, float, float], ...]) -> type[Muon]:
    """Muon whose ``"fast"`` runs ``schedule`` (the same kernels as ``fast``)."""

    class CandidateMuon(Muon):
        @staticmethod
        def orthogonalize(group: dict[str, Any], updates: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(updates) > 1:
                return orthogonalize_batched(updates, schedule, group["eps"])
            return [orthogonalize_with(u, schedule, group["eps"], group["symmetric_blocks"]) for u in updates]

    return CandidateMuon
