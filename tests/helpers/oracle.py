"""The correctness oracle: DDP Muon written plainly, independent of the runtime.

Every rank holds the full model; gradients are all-reduced and averaged (a
parameter with no gradient on any rank keeps ``grad=None``, as DDP does);
``torch.optim.Muon`` updates the 2D parameters and ``torch.optim.AdamW`` the rest.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

MUON_DEFAULTS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW_DEFAULTS = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def recipe_tail_ids(model: nn.Module) -> set[int]:
    """The library's default (the Muon recipe) written plainly: the weights of every nn.Embedding
    and the output head (Hugging Face ``get_output_embeddings()``, else the last nn.Linear whose
    output size is an embedding's vocabulary) train with AdamW."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
        heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in vocab]
        head = heads[-1] if heads else None
    if head is not None:
        ids.add(id(head.weight))
    return ids


def recipe_matrix(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """``is_matrix`` of the default roles: 2-D and not an embedding or the output head."""
    tail = recipe_tail_ids(model)
    return lambda n, p: p.ndim == 2 and id(p) not in tail


def sharded_recipe_matrix(name: str, p: nn.Parameter) -> bool:
    """For a foreign optimizer on a sharded model: the Muon recipe's choice the library recorded on
    the parameter (what ``lightning_matrixfsdp.param_groups`` reads)."""
    return p._mfsdp_recipe.is_matrix and getattr(p, "_mfsdp_role", None) != "tail"


def mark_recipe_tail(model: nn.Module) -> None:
    """Tag the recipe's AdamW parameters of an unsharded model (a DDP run) by hand, so the
    library's Muon, which routes an untagged 2-D tensor to Muon, steps them with AdamW as it
    does under matrix_fsdp by default."""
    for p in model.parameters():
        if id(p) in recipe_tail_ids(model) and getattr(p, "_mfsdp_shard", None) is None:
            p._mfsdp_role = "tail"


def oracle_optimizers(model: nn.Module, is_matrix: Optional[Callable[[str, nn.Parameter], bool]] = None,
                      muon_kw: Optional[dict] = None, adamw_kw: Optional[dict] = None):
    is_matrix = is_matrix or recipe_matrix(model)
    mats = [p for n, p in model.named_parameters() if p.requires_grad and is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not is_matrix(n, p)]
    opts = []
    if mats:
        opts.append(torch.optim.Muon(mats, **{**MUON_DEFAULTS, **(muon_kw or {})}))
    if rest:
        opts.append(torch.optim.AdamW(rest, **{**ADAMW_DEFAULTS, **(adamw_kw or {})}))
    return opts


def allreduce_mean_grads(model: nn.Module, zero_missing: bool = False, group: int = 1) -> None:
    """``zero_missing``: every parameter counts as used (zeros where a rank has no
    gradient), the semantics of ``matrix_shard(zero_missing_grads=True)`` and FSDP2.
    ``group``: see :func:`ordered_all_reduce`."""
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    used = torch.tensor([int(p.grad is not None or zero_missing) for p in params], dtype=torch.int32)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    for p, u in zip(params, used.tolist()):
        if not u:
            p.grad = None
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        p.grad = ordered_all_reduce(g, group) / world


def ordered_all_reduce(g: torch.Tensor, group: int = 1) -> torch.Tensor:
    """All-reduce (sum) with a fixed summation order: rank 0 + rank 1 + ... .

    Mathematically the all-reduce DDP does; the fixed order makes float32 results
    reproducible, so the comparison with the sharded run can be exact where the
    sharded side sums in the same order. ``group > 1``: blocks of ``group`` consecutive
    ranks are summed first (each in rank order), then the blocks in block order (the
    order of HSDP's per-shard-group sums); ``group=1`` is the flat order above.
    """
    world = dist.get_world_size()
    parts = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(parts, g.contiguous())
    total = None
    for b in range(0, world, group):
        block = parts[b].clone()
        for x in parts[b + 1:b + group]:
            block.add_(x)
        total = block if total is None else total.add_(block)
    return total


def clip_global_norm(model: nn.Module, max_norm: float) -> None:
    """DDP's clipping: ``torch.nn.utils.clip_grad_norm_`` over the full gradients (what Lightning's
    precision plugin calls), in the model's parameter order."""
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)


class PerExpertMuon:
    """DDP's optimizer for a model with expert stacks, plainly: ``torch.optim.Muon`` on a separate 2-D
    tensor per expert, copied out of the stack and back (``rows(name, p)``: the height of each expert's
    pieces, e.g. half of a fused ``gate_up_proj`` for gate and up apart; None where ``p`` is no stack),
    on the other matrices as they are, AdamW on the rest (embeddings and head by the recipe default)."""

    def __init__(self, model: nn.Module, rows: Callable[[str, nn.Parameter], Optional[int]]) -> None:
        tail = recipe_tail_ids(model)
        self.links: list[tuple[nn.Parameter, int, int, int, nn.Parameter]] = []
        mats, rest = [], []
        for name, p in model.named_parameters():
            height = rows(name, p)
            if height is not None:
                for e in range(p.shape[0]):
                    for start in range(0, p.shape[1], height):
                        q = nn.Parameter(p.data[e, start:start + height].clone())
                        self.links.append((p, e, start, start + height, q))
                        mats.append(q)
            elif p.ndim == 2 and id(p) not in tail:
                mats.append(p)
            else:
                rest.append(p)
        self.opts = [torch.optim.Muon(mats, **MUON_DEFAULTS), torch.optim.AdamW(rest, **ADAMW_DEFAULTS)]

    def step(self) -> None:
        for p, e, a, b, q in self.links:
            q.grad = p.grad[e, a:b].clone()
        for o in self.opts:
            o.step()
            o.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, e, a, b, q in self.links:
                p[e, a:b] = q
                p.grad = None
