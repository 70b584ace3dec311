"""``QKClipper``: QK-Clip (Kimi K2's MuonClip) on a model, usable from any training loop.

Attached to a model, it records each attention head's largest pre-softmax logit over the
training forwards (``seams.py``, ``logits.py``); its :meth:`QKClipper.step`, called right after
the optimizer's step, takes the maximum over the ranks (``qkclip/comm.py``), turns
the maxima into one factor per query/key row (``rule.py``) and multiplies the rows this rank
holds in place: the whole tensor under DDP or one device, the owner's copy under matrix_fsdp
(non-owners hold empty placeholders and skip), a tensor-parallel fragment's rows, a DTensor's
local shard. Every rank computes the same factors, so the same code gives the same weights
under every strategy.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.qkclip.layouts import AttentionLayout, QKClipError, Target, find_attention
from lightning_matrixfsdp.qkclip.logits import BLOCK_ELEMENTS, LogitMask, head_max_logits
from lightning_matrixfsdp.qkclip.rule import FactorIndex, clip_factors
from lightning_matrixfsdp.qkclip.seams import watch_hf_attention, watch_qkv_output
from lightning_matrixfsdp.runtime import norm_groups, row_span, wait_replicas
from lightning_matrixfsdp.qkclip.comm import agree_on_heads, max_over_ranks

__all__ = ["QKClipper", "check_options"]


def check_options(tau: Any, block_elements: Any = None) -> None:
    """Refuse a ``tau`` that is not a positive finite number, a ``block_elements`` that is not a positive int."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise QKClipError(f"QK-Clip's tau must be a positive finite number (Kimi K2 used 100), got {tau!r}")
    if block_elements is not None and (isinstance(block_elements, bool) or not isinstance(block_elements, int)
                                       or block_elements < 1):
        raise QKClipError(f"QK-Clip's block_elements must be a positive int, got {block_elements!r}")


def _dtensor_span(p: Any) -> tuple[int, int, int]:
    """Rows of a DTensor's local shard: whole unless one mesh dimension shards dim 0 (``Shard(0)``)."""
    from torch.distributed.tensor import Partial, Shard

    whole = int(p.shape[0])
    row_dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0]
    if any(isinstance(pl, Partial) for pl in p.placements) or len(row_dims) > 1:
        raise QKClipError(f"QK-Clip cannot find the rows of a DTensor placed as {p.placements} "
                          "(rows sharded on several mesh dimensions, or a partial sum); use matrix_fsdp with "
                          "tensor parallelism, or shard the attention's projections along one mesh dimension")
    if not row_dims:
        return 0, whole, whole
    mesh_dim = row_dims[0]
    n, coord = p.device_mesh.size(mesh_dim), p.device_mesh.get_coordinate()[mesh_dim]
    step = -(-whole // n)
    start = min(whole, coord * step)
    return start, max(0, min(step, whole - start)), whole


def _refuse_flat_parameters(model: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise QKClipError("QK-Clip cannot rescale the flat parameters of FullyShardedDataParallel (FSDP1, Lightning's "
                          "FSDPStrategy): a head's rows may span ranks' flat shards. Use strategy='matrix_fsdp', DDP, "
                          "or FSDP2 (fully_shard)")


class _Bound:
    """A target with its factor-table entries per whole row, sliced to this rank's rows on use."""

    def __init__(self, target: Target, rows: torch.Tensor) -> None:
        self.target, self.rows = target, rows
        self.seen: Any = None
        self.local_rows: Optional[torch.Tensor] = None


class QKClipper:
    """QK-Clip on ``model``: call :meth:`step` after every ``optimizer.step()`` (not after the
    backward of a micro-batch that does not step); :meth:`remove` detaches it.

    ``tau``: the logit threshold (Kimi K2 used 100). ``group``: the ranks over which the maxima
    are reduced, all holding the same model (default: the world). ``block_elements``: logits one
    block of the measurement holds. Attach after the model is sharded or parallelized (the
    Lightning callback does it at the start of ``fit``). docs/qk-clip.md has the rule."""

    def __init__(self, model: nn.Module, tau: float = 100.0, group: Optional[dist.ProcessGroup] = None,
                 block_elements: int = BLOCK_ELEMENTS) -> None:
        check_options(tau, block_elements)
        _refuse_flat_parameters(model)
        self.model, self.tau, self.group, self.block_elements = model, float(tau), group, block_elements
        self.layouts: list[AttentionLayout] = find_attention(model, lambda p: self._span(p)[2])
        self.index = FactorIndex([lay.heads for lay in self.layouts])
        device = self.layouts[0].q_source.param.device
        if device.type == "meta":
            raise QKClipError("QK-Clip: the model's weights are still on the meta device; attach it after they are "
                              "materialized (after sharding and loading)")
        self.index.to(device)
        self.maxima = torch.full((self.index.n_heads,), float("-inf"), dtype=torch.float32, device=device)
        self.last_maxima: Optional[torch.Tensor] = None
        self._local_heads = [self._heads_here(lay) for lay in self.layouts]
        self.bound = self._bind(device)
        groups = norm_groups(model)
        self._stats = groups.stats if groups is not None else None
        describe = f"{len(self.layouts)} layers, {self.index.n_heads} heads, tau {self.tau}"
        digest = hashlib.sha256(repr([(lay.fqn, lay.heads, [t.fqn for t in lay.targets]) for lay in self.layouts]
                                     + [self.tau]).encode()).hexdigest()
        agree_on_heads(digest, describe, group)
        self._calls = [0] * len(self.layouts)
        self._records = [0] * len(self.layouts)
        self._handles = self._watch()

    # ------------------------------------------------------------------ where rows and heads are
    def _span(self, p: Any) -> tuple[int, int, int]:
        span = row_span(self.model, p)
        if span is not None:
            return span
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor):
            return _dtensor_span(p)
        return 0, int(p.shape[0]), int(p.shape[0])

    def _heads_here(self, lay: AttentionLayout) -> Optional[tuple[int, int]]:
        """(first head, heads) of the query heads a rank computes when its tensor-parallel fragment
        of the query projection holds whole heads; None where it does not (the rows of a fragment
        or shard that the attention gathers back, like FSDP2's, need not align with heads)."""
        start, rows, whole = self._span(lay.q_source.param)
        rph = lay.rows_per_head
        if rows == whole or lay.seam == "qkv":
            return 0, lay.heads.heads
        if start % rph or rows % rph:
            return None
        return start // rph, rows // rph

    def _bind(self, device: torch.device) -> list[_Bound]:
        bound, frozen = [], []
        for i, lay in enumerate(self.layouts):
            for t in lay.targets:
                if not t.param.requires_grad:
                    frozen.append(t.fqn)
                    continue
                bound.append(_Bound(t, self.index.rows(i, t.kinds).to(device)))
        if frozen:
            warnings.warn(f"QK-Clip leaves frozen tensors as they are: {', '.join(frozen)}", stacklevel=3)
        return bound

    # ------------------------------------------------------------------ measurement
    def _watch(self) -> list[Any]:
        handles = []
        for i, lay in enumerate(self.layouts):
            record = self._recorder(i)
            if lay.seam == "qkv":
                handles.append(watch_qkv_output(lay.module, lay.q_source.module, lay.heads.heads, record))
            else:
                handles.append(watch_hf_attention(lay.module, record))
            handles.append(lay.module.register_forward_pre_hook(self._counter(i)))
        return handles

    def _counter(self, i: int) -> Any:
        def count(module: nn.Module, args: Any) -> None:
            if module.training:
                self._calls[i] += 1
        return count

    def _recorder(self, i: int) -> Any:
        lay = self.layouts[i]
        here = self._local_heads[i]
        base = self.index.head_offsets[i]

        def record(q: torch.Tensor, k: torch.Tensor, mask: LogitMask, scale: Optional[float]) -> None:
            h = q.shape[1]
            if h == lay.heads.heads:
                lo = 0
            elif here is not None and h == here[1]:
                lo = here[0]
            else:
                raise QKClipError(
                    f"QK-Clip: {lay.fqn} computed {h} of its {lay.heads.heads} query heads, and this rank's rows of "
                    f"{lay.q_source.fqn} do not say which: split the query projection by whole heads, and attach "
                    "QK-Clip after parallelizing the model")
            s = lay.scale if scale is None and lay.scale is not None else scale
            s = q.shape[-1] ** -0.5 if s is None else float(s)
            with torch.autocast(q.device.type, enabled=False):
                m = head_max_logits(q, k, s, mask, self.block_elements)
            seg = self.maxima[base + lo: base + lo + h]
            seg.copy_(torch.maximum(seg, m.to(seg.device)))
            self._records[i] += 1

        return record

    # ------------------------------------------------------------------ the step
    def _check_records(self) -> None:
        missing = [lay.fqn for lay, c, r in zip(self.layouts, self._calls, self._records) if c and not r]
        self._calls = [0] * len(self.layouts)
        self._records = [0] * len(self.layouts)
        if missing:
            raise QKClipError(
                f"QK-Clip saw the training forward of {missing[0]} (and {len(missing) - 1} more) but not its "
                "attention logits: its attention function was not called through transformers' AttentionInterface "
                "(a custom or compiled attention?). Use attn_implementation='sdpa' or 'eager' in eager mode")

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Reduce the maxima over the ranks, rescale the query/key rows this rank holds, start a
        new measurement. Returns the step's largest logit of every head (flat, layer by layer).
        Collective: every rank of ``group`` calls it after the same optimizer step."""
        self._check_records()
        maxima = max_over_ranks(self.maxima, self.group, self._stats)
        wait_replicas(self.model)  # replica_split: weights still arriving would overwrite the scaled ones
        table = clip_factors(maxima, self.tau, self.index)
        for b in self.bound:
            self._scale(b, table)
        self.maxima.fill_(float("-inf"))
        self.last_maxima = maxima
        return maxima

    def _scale(self, b: _Bound, table: torch.Tensor) -> None:
        p = b.target.param
        if p is not b.seen:  # first step, or the parameter object was replaced (resharded, reloaded)
            start, rows, _ = self._span(p)
            b.seen, b.local_rows = p, b.rows[start:start + rows]
        from torch.distributed.tensor import DTensor

        local = p.to_local() if isinstance(p, DTensor) else p.data
        rows = b.local_rows
        if local.numel() == 0 or rows is None or local.shape[0] != rows.numel():
            return  # not this rank's data (an owner placeholder), or nothing in this fragment
        factors = table[rows].to(local.dtype)
        local.mul_(factors.reshape(-1, *([1] * (local.dim() - 1))))

    def clipped_heads(self) -> Optional[torch.Tensor]:
        """How many heads exceeded ``tau`` at the last step (a device tensor; None before it)."""
        return None if self.last_maxima is None else (self.last_maxima > self.tau).sum()

    def remove(self) -> None:
        """Stop measuring (the model's forwards are as without QK-Clip)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "QKClipper":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
