"""QK-Clip's rule, pure: from every head's largest logit of the step to one factor per weight row.

Per query head ``h`` with largest logit ``S_h``: ``gamma_h = min(1, tau / S_h)`` (1 where
``S_h <= tau``, also for a head that saw no token). A row of a weight (or an entry of a bias or
norm weight) is multiplied by one of these factors, named by its :class:`Kind`:

* ``Q``: a head's own query part (regular attention's ``q``, MLA's ``q_C``): ``sqrt(gamma_h)``;
* ``QR``: MLA's per-head rotary query ``q_R``: ``gamma_h`` (its key ``k_R`` is shared and left alone);
* ``K``: a key head, shared by the ``H / KV`` query heads of its group under grouped-query
  attention: ``sqrt(min gamma)`` over the group (``sqrt(gamma_h)`` without GQA, and MLA's ``k_C``);
* ``LAYER``: a tensor every head of the layer reads (a ``q_norm`` / ``k_norm`` weight of one head's
  size): ``sqrt(min gamma)`` over the layer's heads;
* ``NONE``: not a query or key row (``v`` in a fused projection): 1.

Every factor is at most 1 and exactly 1 where no head it serves exceeded ``tau``, so untouched
rows keep their bits. A head's logits shrink by ``sqrt(gamma_h) * sqrt(min over its group)``,
which is at most ``gamma_h``: each head ends at or below ``tau`` on the step's inputs.

:class:`FactorIndex` lays the factors of all layers out in one table (``[1, Q..., QR..., K...,
LAYER...]``) so that a weight's per-row factors are one gather of precomputed row indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch

__all__ = ["FactorIndex", "Kind", "LayerHeads", "clip_factors", "gammas"]


class Kind(IntEnum):
    NONE = 0
    Q = 1
    QR = 2
    K = 3
    LAYER = 4


@dataclass(frozen=True)
class LayerHeads:
    """One attention layer's heads: ``heads`` query heads reading ``kv_heads`` key heads
    (query head ``h`` reads key head ``h // (heads // kv_heads)``)."""

    heads: int
    kv_heads: int

    def __post_init__(self) -> None:
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads cannot share {self.kv_heads} key heads evenly")


class FactorIndex:
    """Where each layer's heads, key heads and layer factor sit in the flat maxima and the factor table."""

    def __init__(self, layers: Sequence[LayerHeads]) -> None:
        self.layers = list(layers)
        self.head_offsets: list[int] = []
        self.kv_offsets: list[int] = []
        n = nk = 0
        group, layer = [], []
        for i, lay in enumerate(self.layers):
            self.head_offsets.append(n)
            self.kv_offsets.append(nk)
            rep = lay.heads // lay.kv_heads
            group += [nk + h // rep for h in range(lay.heads)]
            layer += [i] * lay.heads
            n += lay.heads
            nk += lay.kv_heads
        self.n_heads, self.n_kv = n, nk
        self.group_of_head = torch.tensor(group, dtype=torch.long)
        self.layer_of_head = torch.tensor(layer, dtype=torch.long)

    def to(self, device: torch.device) -> "FactorIndex":
        """Keep the head-to-group and head-to-layer maps on ``device`` (where the maxima live)."""
        self.group_of_head = self.group_of_head.to(device)
        self.layer_of_head = self.layer_of_head.to(device)
        return self

    def slot(self, layer: int, kind: Kind, index: int) -> int:
        """The factor table's entry of ``kind`` for head (``Q``, ``QR``), key head (``K``) or
        the layer itself (``LAYER``; ``index`` ignored); 0 is the constant 1."""
        n, nk = self.n_heads, self.n_kv
        if kind == Kind.NONE:
            return 0
        if kind == Kind.Q:
            return 1 + self.head_offsets[layer] + index
        if kind == Kind.QR:
            return 1 + n + self.head_offsets[layer] + index
        if kind == Kind.K:
            return 1 + 2 * n + self.kv_offsets[layer] + index
        return 1 + 2 * n + nk + layer

    def rows(self, layer: int, kinds: Sequence[tuple[Kind, int]]) -> torch.Tensor:
        """Table entries of a tensor's rows, given each row's (kind, head or key head)."""
        return torch.tensor([self.slot(layer, k, i) for k, i in kinds], dtype=torch.long)


def gammas(maxima: torch.Tensor, tau: float) -> torch.Tensor:
    """``min(1, tau / S)`` per head, in float32; 1 where ``S <= tau`` (and for ``-inf``)."""
    s = maxima.float()
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def clip_factors(maxima: torch.Tensor, tau: float, index: FactorIndex) -> torch.Tensor:
    """The factor table ``[1, sqrt(gamma) per head, gamma per head, sqrt(min gamma) per key head,
    sqrt(min gamma) per layer]`` for the step's ``maxima`` (every layer's heads, flat)."""
    g = gammas(maxima, tau)
    dev = g.device
    ones = torch.ones(1, dtype=g.dtype, device=dev)
    per_kv = torch.ones(index.n_kv, dtype=g.dtype, device=dev).scatter_reduce(
        0, index.group_of_head, g, reduce="amin")
    per_layer = torch.ones(len(index.layers), dtype=g.dtype, device=dev).scatter_reduce(
        0, index.layer_of_head, g, reduce="amin")
    return torch.cat([ones, g.sqrt(), g, per_kv.sqrt(), per_layer.sqrt()])
