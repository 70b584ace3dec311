"""The largest pre-softmax logit of each attention head, from the q and k an attention already has.

``head_max_logits(q, k, scale, mask)`` returns, per query head, ``scale * max q_i . k_j`` over the
batch and over every (query i, key j) pair the softmax sees. It never materializes the whole
``[B, H, T, S]`` logit tensor: the queries go in blocks sized to ``block_elements`` logits, and
under a causal mask each block reads only the keys at or before its last query (the keys
before its first query need no mask at all). Everything runs under ``no_grad`` on detached
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


def _block_rows(b: int, h: int, t: int, s: int, block_elements: int) -> int:
    return max(1, min(t, block_elements // max(1, b * h * s)))


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
        # ``allowed`` is [B|1, H|1, rows, keys]; heads split as (KV, rep)
        b, kv, rep = logits.shape[:3]
        if allowed.dim() == 4 and allowed.shape[1] != 1:
            allowed = allowed.reshape(allowed.shape[0], kv, rep, *allowed.shape[2:])
        else:
            allowed = allowed.unsqueeze(1) if allowed.dim() == 4 else allowed
        logits = logits.masked_fill_(~allowed, float("-inf"))
    return logits.amax(dim=(0, 3, 4))


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
    out = torch.full((kv, rep), float("-inf"), dtype=torch.float32, device=q.device)
    if b == 0 or t == 0 or s == 0:
        return out.reshape(h)
    qg = q.reshape(b, kv, rep, t, d)
    off = s - t
    rows = _block_rows(b, h, t, s, block_elements)
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        qb = qg[:, :, :, i0:i1, :].reshape(b, kv, rep * (i1 - i0), d)
        if mask.plain_causal:
            # keys up to the block's first query are seen by every query of the block: no mask
            full = min(s, max(0, i0 + off + 1))
            last = min(s, max(0, i1 + off))
            spans = [(0, full, None), (full, last, _pair_mask(mask, i0, i1, full, last, off, q.device))]
        else:
            last = min(s, i1 + off) if mask.causal else s
            spans = [(0, last, _pair_mask(mask, i0, i1, 0, last, off, q.device))]
        for k0, k1, allowed in spans:
            if k1 <= k0:
                continue
            logits = torch.matmul(qb, k[:, :, k0:k1, :].transpose(-1, -2))
            logits = logits.reshape(b, kv, rep, i1 - i0, k1 - k0)
            out = torch.maximum(out, _masked_max(logits, allowed).float())
    return (out * scale).reshape(h)
