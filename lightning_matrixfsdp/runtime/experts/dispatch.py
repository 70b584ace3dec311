"""Expert parallelism's token dispatch: tokens go to their expert's rank, results come back.

The ranks of an expert-parallel group of size EP hold the E experts of a layer in contiguous
blocks: rank ``r`` holds global experts ``[r*E/EP, (r+1)*E/EP)``. :func:`expert_parallel_forward`
takes a router's top-k choices and

1. sorts this rank's (token, slot) pairs by global expert, then token, then slot, and tells
   every rank how many rows it will get for each of its experts (the counts exchange);
2. sends each row of hidden states to its expert's rank (token all-to-all, ``experts/dispatch_comm.py``);
3. regroups the rows it received expert-major (inside an expert: by source rank, then token,
   then slot) and runs ``local_experts`` on them;
4. sends the results back the same way and sums each token's k contributions, weighted by
   the router, in slot order (slot 0 first).

With ``group=None`` or a group of one rank the same code runs without communication. A slot
whose expert index is ``E`` (the "no expert" value Hugging Face's expert loops skip) goes
nowhere and adds nothing; any other index outside ``[0, E)`` is refused, on every rank (the
refusal travels in the counts exchange). An expert that receives no token still runs on an
empty batch, so its weights get a gradient of zeros (not None).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup
from lightning_matrixfsdp.runtime.experts.dispatch_comm import (EP_COMBINE, EP_DISPATCH, all_to_all_tokens, exchange_counts,
                                                  expert_group)
from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["LocalExperts", "dtype_code", "dtype_of_code", "expert_parallel_forward", "grouped_mm_available",
           "hf_experts", "hf_experts_forward"]

#: ``local_experts(x_sorted, counts)``: this rank's experts on rows grouped expert-major
#: (``counts[i]`` rows for local expert ``i``), returning ``[sum(counts), H]``.
LocalExperts = Callable[[torch.Tensor, list[int]], torch.Tensor]

#: The header after the counts in each row of the counts exchange: status, H, dtype code.
_HEADER = 3
_OK, _BAD_SHAPES, _BAD_INDEX = 0, 1, 2
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer for the dtype of hidden states (the counts exchange's header, the join's
    announcements); a dtype outside the known four gets ``4 + itemsize``, which names no dtype."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + dtype.itemsize


def dtype_of_code(code: int) -> Optional[torch.dtype]:
    """The dtype :func:`dtype_code` gave ``code``; None where the code names none."""
    return _DTYPES[code] if 0 <= code < len(_DTYPES) else None


def _check_inputs(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int
                  ) -> tuple[int, Optional[str]]:
    """(status, message): what is wrong with this rank's inputs, if anything."""
    if hidden.dim() != 2:
        return _BAD_SHAPES, f"hidden must be [tokens, hidden size], got shape {tuple(hidden.shape)}"
    if index.dim() != 2 or index.shape[0] != hidden.shape[0] or tuple(weights.shape) != tuple(index.shape):
        return _BAD_SHAPES, (f"top_k_index {tuple(index.shape)} and top_k_weights {tuple(weights.shape)} must both be "
                             f"[tokens, k] with the {hidden.shape[0]} tokens of hidden")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        return _BAD_SHAPES, f"top_k_index must hold integers, got {index.dtype}"
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi > num_experts:
            bad = lo if lo < 0 else hi
            return _BAD_INDEX, (f"top_k_index holds expert {bad}, outside [0, {num_experts}) (the value "
                                f"{num_experts} means 'no expert')")
    return _OK, None


def _refuse_if_any(received: torch.Tensor, status: int, message: Optional[str], sg: ShardGroup) -> None:
    """Raise on every rank when any rank refused its inputs or the ranks disagree on H or dtype."""
    head = received[:, -_HEADER:].tolist()
    bad = [s for s, (st, _, _) in enumerate(head) if st != _OK]
    if bad:
        if message is not None:
            raise MatrixShardError(f"expert_parallel_forward, rank {sg.rank} of the expert-parallel group: {message}")
        raise MatrixShardError(f"expert_parallel_forward: rank(s) {bad} of the expert-parallel group refused their "
                               "inputs (their error names the cause); nothing was exchanged")
    if len({(h, code) for _, h, code in head}) > 1:
        names = [(h, str(_DTYPES[c]) if c < len(_DTYPES) else f"{c - len(_DTYPES)}-byte dtype") for _, h, c in head]
        raise MatrixShardError("expert_parallel_forward: the ranks of the expert-parallel group disagree on the "
                               f"hidden size or dtype of hidden: (H, dtype) per rank {names}")


def _expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """Positions in the received rows (source-major: rank 0's rows for each of its experts,
    then rank 1's ...) in expert-major order (expert, then source rank)."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts).t().reshape(-1)
    lens = recv_counts.t().reshape(-1)
    n = int(lens.sum())
    seg_start = torch.cumsum(lens, 0) - lens
    return torch.repeat_interleave(starts - seg_start, lens, output_size=n) + torch.arange(n)


def expert_parallel_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            num_experts: int, local_experts: LocalExperts,
                            group: Optional[torch.distributed.ProcessGroup], *,
                            stats: Optional[CommStats] = None,
                            on_counts: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """``sum_j top_k_weights[t, j] * expert[top_k_index[t, j]](hidden[t])`` for every token ``t``,
    the experts spread over ``group`` in contiguous blocks (see the module docstring).

    ``hidden`` [T, H], ``top_k_index`` [T, k] (global expert ids, ``num_experts`` = no expert),
    ``top_k_weights`` [T, k]; returns [T, H] in ``hidden``'s dtype. ``stats`` counts the bytes
    under ``ep_dispatch`` and ``ep_combine``; ``on_counts`` gets this rank's tokens per global
    expert, ``[E + 1]`` on the host (the last: slots routed to no expert), the counts the
    exchange computes anyway (``experts/stats.py``). Every rank of ``group`` must call it, in the
    same order (it communicates in forward and in backward)."""
    sg = expert_group(group)
    ep = sg.size
    if num_experts < 1 or num_experts % ep:
        raise MatrixShardError(f"expert_parallel_forward: {num_experts} experts cannot be split into {ep} equal "
                               "contiguous blocks (the number of experts must be a multiple of the expert-parallel size)")
    per_rank = num_experts // ep
    status, message = _check_inputs(hidden, top_k_index, top_k_weights, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long)
    if status == _OK:
        flat = top_k_index.reshape(-1).long()
        every = torch.bincount(flat, minlength=num_experts + 1).cpu()
        counts = every[:num_experts]
        if on_counts is not None:
            on_counts(every)
    h = int(hidden.shape[-1]) if hidden.dim() else 0
    header = torch.tensor([[status, h, dtype_code(hidden.dtype)]], dtype=torch.long).expand(ep, _HEADER)
    rows = torch.cat([counts.view(ep, per_rank), header], dim=1).to(hidden.device)
    received = exchange_counts(rows, sg, stats).cpu()
    _refuse_if_any(received, status, message, sg)

    tokens, k = top_k_index.shape
    # (expert, token, slot) order: a stable sort of the flat (token, slot) positions by expert;
    # the "no expert" slots (index E) sort last and are not sent.
    order = torch.sort(flat, stable=True).indices
    n_sent = int(counts.sum())
    # Each slot's own copy of its token (expand, then pick unique rows): the gradient of hidden
    # is then a sum over the k slots in a fixed order, with no scattered accumulation.
    slots_in = hidden.unsqueeze(1).expand(tokens, k, h).reshape(tokens * k, h)
    x_send = slots_in[order[:n_sent]]
    recv_counts = received[:, :per_rank]
    send_splits = counts.view(ep, per_rank).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    x_recv = all_to_all_tokens(x_send, send_splits, recv_splits, sg, stats, EP_DISPATCH)

    perm = _expert_major(recv_counts).to(hidden.device)
    local_counts = recv_counts.sum(0).tolist()
    y_sorted = local_experts(x_recv[perm], local_counts)
    if tuple(y_sorted.shape) != (sum(local_counts), h):
        raise MatrixShardError(f"expert_parallel_forward: local_experts returned shape {tuple(y_sorted.shape)} "
                               f"for {sum(local_counts)} rows of hidden size {h}; expected ({sum(local_counts)}, {h})")
    y_recv = y_sorted[torch.argsort(perm)]
    y_back = all_to_all_tokens(y_recv, recv_splits, send_splits, sg, stats, EP_COMBINE)

    unused = y_back.new_zeros(tokens * k - n_sent, h)
    y_slots = torch.cat([y_back, unused])[torch.argsort(order)].view(tokens, k, h)
    weights = top_k_weights.masked_fill(top_k_index == num_experts, 0)
    out = None
    for j in range(k):  # slot order: the sum does not depend on where the experts ran
        part = y_slots[:, j] * weights[:, j, None]
        out = part if out is None else out + part
    if out is None:
        return hidden.new_zeros(tokens, h)
    return out.to(hidden.dtype)


# ------------------------------------------------------------------ the Hugging Face expert layout
def grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` (public in torch 2.11 and 2.13) serves these tensors:
    CUDA, bfloat16 throughout, the sizes multiples of 8 (its 16-byte alignment). Its CPU
    backward fails for some layouts in torch 2.13, so the CPU always takes the loop."""
    return (hasattr(F, "grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and all(w.is_cuda and w.dtype == torch.bfloat16 for w in weights)
            and all(s % 8 == 0 for w in weights for s in w.shape[1:]))


def hf_experts_forward(x: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       act_fn: Callable[[torch.Tensor], torch.Tensor], *, grouped_mm: Optional[bool] = None
                       ) -> torch.Tensor:
    """The Mixtral / Qwen3-MoE experts on expert-major rows: for local expert ``e``,
    ``gate, up = (x @ gate_up_proj[e].T).chunk(2)``, then ``(act(gate) * up) @ down_proj[e].T``.
    ``gate_up_proj`` [E_local, 2I, H], ``down_proj`` [E_local, H, I]. ``grouped_mm``: None picks
    :func:`grouped_mm_available`; False is the per-expert loop (empty experts included, so each
    gets a zero gradient)."""
    if len(counts) != gate_up_proj.shape[0] or down_proj.shape[0] != gate_up_proj.shape[0]:
        raise MatrixShardError(f"hf_experts_forward: {len(counts)} counts for gate_up_proj {tuple(gate_up_proj.shape)} "
                               f"and down_proj {tuple(down_proj.shape)}: one count per local expert")
    if grouped_mm is None:
        grouped_mm = grouped_mm_available(x, gate_up_proj, down_proj)
    if grouped_mm:
        # int32 on the device (cumsum of integers gives int64, which grouped_mm refuses)
        offs = torch.cumsum(torch.tensor(counts), 0).to(x.device, torch.int32)
        gate, up = F.grouped_mm(x, gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(act_fn(gate) * up, down_proj.transpose(-2, -1), offs=offs)
    outs, start = [], 0
    for e, c in enumerate(counts):
        gate, up = F.linear(x[start:start + c], gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down_proj[e]))
        start += c
    return torch.cat(outs)


def hf_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
               *, grouped_mm: Optional[bool] = None) -> LocalExperts:
    """:func:`hf_experts_forward` bound to one rank's expert weights: a ``local_experts``."""
    def run(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return hf_experts_forward(x, counts, gate_up_proj, down_proj, act_fn, grouped_mm=grouped_mm)
    return run
