"""The largest pre-softmax logit of each attention head, from the q and k an attention already has.

``head_max_logits(q, k, scale, mask)`` returns, per query head, ``scale * max q_i . k_j`` over the
batch and over every (query i, key j) pair the softmax sees. It never materializes the whole
``[B, H, T, S]`` logit tensor: the queries go in blocks of at most ``block_elements`` logits, and
under a plain causal mask (blocks of ``CAUSAL_ROWS`` queries) each block reads the keys before
it without a mask and its own square block under a cached ``-inf`` upper triangle: about half
of the products. Everything runs under ``no_grad`` on detached
inputs, so the attention's outputs and gradients are untouched.

The products are taken in the inputs' dtype (bfloat16 on a GPU run: the maximum is then rounded
to bfloat16, a relative error of at most 2^-8); masked pairs are set to ``-inf`` before the
maximum. A head with no allowed pair (a batch of padding) reads ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["LogitMask", "head_max_logits"]

#: logits one block may hold (64 Mi elements: 128 MiB in bfloat16)
BLOCK_ELEMENTS = 1 << 26
#: query rows of one block under a plain causal mask, by device type: the keys after a block's
#: first query are computed and masked (about ``rows / T`` of the work), while every block costs
#: a few kernel launches (on a CPU 64-128 rows measured fastest; 512 elsewhere: fewer launches)
CAUSAL_ROWS = {"cpu": 128}
CAUSAL_ROWS_DEFAULT = 512


@dataclass(frozen=True)
class LogitMask:
    """Which (query, key) pairs the softmax sees. ``allowed``: a boolean tensor broadcastable to
    ``[B, H, T, S]`` (True: seen), or None. ``causal``: query ``i`` sees keys ``j <= i + S - T``
    (aligned at the end, as a cache-less training step has ``S == T``). ``window``: also
    ``i + S - T - j < window``. ``segments``: ``[B, S]`` ids; a query sees only keys of its own
    segment (packed sequences, ``T == S``)."""

    allowed: Optional[torch.Tensor] = None
    causal: bool = False
    window: Optional[int] = None
    segments: Optional[torch.Tensor] = None

    @property
    def plain_causal(self) -> bool:
        return self.causal and self.allowed is None and self.window is None and self.segments is None


def _pair_mask(mask: LogitMask, i0: int, i1: int, k0: int, k1: int, off: int, device: torch.device) -> Optional[torch.Tensor]:
    """The boolean mask of queries ``[i0, i1)`` x keys ``[k0, k1)``, broadcastable to ``[B, H, rows, keys]``."""
    out: Optional[torch.Tensor] = None
    if mask.allowed is not None:
        out = mask.allowed[..., i0:i1, k0:k1]
    if mask.causal or mask.window is not None:
        qi = torch.arange(i0, i1, device=device).unsqueeze(1) + off
        kj = torch.arange(k0, k1, device=device).unsqueeze(0)
        rule = kj <= qi if mask.causal else torch.ones_like(qi - kj, dtype=torch.bool)
        if mask.window is not None:
            rule = rule & (qi - kj < mask.window)
        out = rule if out is None else out & rule
    if mask.segments is not None:
        seg = mask.segments
        same = seg[:, i0:i1].unsqueeze(2) == seg[:, k0:k1].unsqueeze(1)  # [B, rows, keys]
        same = same.unsqueeze(1)
        out = same if out is None else out & same
    return out


def _masked_max(logits: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """``logits`` ``[B, KV, rep, rows, keys]`` -> ``[KV, rep]`` maximum over batch, rows, keys."""
    if allowed is not None:
        # ``allowed`` is [B|1, H|1, rows, keys] (heads split as (KV, rep)) or [rows, keys]
        b, kv, rep = logits.shape[:3]
        if allowed.dim() == 4 and allowed.shape[1] != 1:
            allowed = allowed.reshape(allowed.shape[0], kv, rep, *allowed.shape[2:])
        elif allowed.dim() == 4:
            allowed = allowed.unsqueeze(1)
        logits = logits.masked_fill_(~allowed, float("-inf"))
    return logits.amax(dim=(0, 3, 4))


def _upper_inf(rows: int, dtype: torch.dtype, device: torch.device, cache: dict) -> torch.Tensor:
    """``[rows, rows]``: 0 on and below the diagonal, ``-inf`` above (a causal block's own keys)."""
    key = (rows, dtype, device)
    if key not in cache:
        cache[key] = torch.full((rows, rows), float("-inf"), dtype=dtype, device=device).triu_(1)
    return cache[key]


_TRIANGLES: dict = {}


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, mask: LogitMask,
                    block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Per query head, ``scale`` times the largest ``q_i . k_j`` the softmax sees: ``[H]`` float32.

    ``q``: ``[B, H, T, d]``; ``k``: ``[B, KV, S, d]`` with ``H`` a multiple of ``KV`` (query head
    ``h`` reads key head ``h // (H // KV)``, Hugging Face's ``repeat_kv``)."""
    q, k = q.detach(), k.detach()
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    rep = h // kv
    if b == 0 or t == 0 or s == 0:
        return torch.full((h,), float("-inf"), dtype=torch.float32, device=q.device)
    qg = q.reshape(b, kv, rep, t, d)
    off = s - t
    rows = max(1, min(t, block_elements // max(1, b * h * s)))
    if mask.plain_causal and off == 0:
        return _causal_max(qg, k, min(rows, CAUSAL_ROWS.get(q.device.type, CAUSAL_ROWS_DEFAULT)), scale)
    parts = []
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        qb = qg[:, :, :, i0:i1, :].reshape(b, kv, rep * (i1 - i0), d)
        last = min(s, i1 + off) if mask.causal else s
        if last <= 0:
            continue
        logits = torch.matmul(qb, k[:, :, :last, :].transpose(-1, -2)).reshape(b, kv, rep, i1 - i0, last)
        parts.append(_masked_max(logits, _pair_mask(mask, i0, i1, 0, last, off, q.device)))
    return _combine(parts, h, scale, q.device)


def _causal_max(qg: torch.Tensor, k: torch.Tensor, rows: int, scale: float) -> torch.Tensor:
    """The causal case (``S == T``, no other mask): each query block reads the keys before it
    without a mask and its own square block under a cached ``-inf`` upper triangle."""
    b, kv, rep, t, d = qg.shape
    parts = []
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        n = i1 - i0
        qb = qg[:, :, :, i0:i1, :].reshape(b, kv, rep * n, d)
        if i0 > 0:
            before = torch.matmul(qb, k[:, :, :i0, :].transpose(-1, -2))
            parts.append(before.reshape(b, kv, rep, n * i0).amax(dim=(0, 3)))
        own = torch.matmul(qb, k[:, :, i0:i1, :].transpose(-1, -2)).reshape(b, kv, rep, n, n)
        own.add_(_upper_inf(n, own.dtype, own.device, _TRIANGLES))
        parts.append(own.amax(dim=(0, 3, 4)))
    return _combine(parts, rep * kv, scale, qg.device)


def _combine(parts: list, h: int, scale: float, device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.full((h,), float("-inf"), dtype=torch.float32, device=device)
    return (torch.stack(parts).amax(0).float() * scale).reshape(h)
