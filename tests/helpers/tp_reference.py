"""Tensor-parallel test helpers: a tiny model with every kind of split, its TP plan, and the
plain reference the sharded runs are held to (independent of the runtime).

The reference is data parallel plus the *same* TP plan: the model is parallelized as in the
sharded run (so forward and backward are the same float operations), each local gradient is
averaged over the data-parallel ranks in rank order, and every TP-split matrix is gathered
whole over the TP group and stepped by ``torch.optim.Muon`` on the whole matrix; every rank
keeps its slice. ``blockwise=True`` steps each fragment alone instead (the negative control:
Megatron's blockwise mode, whose update depends on the TP size).

Options shared by the model, the plan and the reference: ``plan`` ("basic"; "sp": sequence
parallel, the residual stream split by rows between the layers, the norm and ``gate`` as
``SequenceParallel``, the head colwise and gathered; "lp": the head colwise with its logits left
as a DTensor for ``loss_parallel()``'s cross-entropy), ``frozen`` (parameter names set to
``requires_grad=False`` after the plan), ``zero_missing`` (a parameter without a local gradient
counts as zeros in the data-parallel mean: ``zero_missing_grads``). ``Block.skip_mlp`` leaves
the MLP out of a forward (set per step and rank by the scenarios).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

#: split matrices of a block: name -> the dimension ``parallelize_module`` splits
SPLIT = {"qkv.weight": 0, "proj.weight": 1, "up.weight": 0, "down.weight": 1}
#: split biases (the colwise layers'): AdamW steps them where they are, the norm gathers them
SPLIT_BIAS = {"qkv.bias": 0, "up.bias": 0}
#: the head, split colwise by the "sp" and "lp" plans
HEAD_SPLIT = {"head.weight": 0, "head.bias": 0}


class Block(nn.Module):
    """A fused QKV (colwise) into a rowwise projection; an uneven colwise/rowwise pair (11 over 2
    ranks: 6 and 5); a matrix TP leaves whole (``gate``); a LayerNorm (replicated tail)."""

    def __init__(self, d: int = 8, h: int = 11) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(3 * d, d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.gate = nn.Linear(d, d, bias=False)
        self.skip_mlp = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(torch.tanh(self.qkv(self.norm(x))))
        if self.skip_mlp:
            return x + self.gate(x)
        return x + self.down(torch.relu(self.up(x))) + self.gate(x)


class Net(nn.Module):
    def __init__(self, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def parallelize(model: Net, tp_mesh, plan: str = "basic", frozen=()) -> Net:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    rows = Shard(0)  # "sp": the residual stream split by rows (the tests' sequence dimension)
    for b in model.blocks:
        if plan == "sp":
            parallelize_module(b, tp_mesh, {"norm": SequenceParallel(sequence_dim=0),
                                            "qkv": ColwiseParallel(input_layouts=rows),
                                            "proj": RowwiseParallel(output_layouts=rows),
                                            "up": ColwiseParallel(input_layouts=rows, output_layouts=Replicate()),
                                            "down": RowwiseParallel(input_layouts=Replicate(), output_layouts=rows),
                                            "gate": SequenceParallel(sequence_dim=0, use_local_output=True)})
        else:
            parallelize_module(b, tp_mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                            "up": ColwiseParallel(output_layouts=Replicate()),
                                            "down": RowwiseParallel(input_layouts=Replicate())})
    if plan == "sp":
        parallelize_module(model, tp_mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=rows, use_local_output=True),
            "head": ColwiseParallel(input_layouts=rows, output_layouts=Replicate())})
    elif plan == "lp":
        parallelize_module(model, tp_mesh, {"head": ColwiseParallel(use_local_output=False)})
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def split_dim(name: str, plan: str = "basic"):
    if plan != "basic" and name in HEAD_SPLIT:
        return HEAD_SPLIT[name]
    return SPLIT.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None


def whole_dim(name: str, plan: str = "basic"):
    """The split dimension of any parameter (matrices and biases), or None where TP leaves it whole."""
    dim = split_dim(name, plan)
    return dim if dim is not None or not name.startswith("blocks.") else SPLIT_BIAS.get(name.split(".", 2)[-1])


def batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 17 * step + dp_rank)
    return torch.randn(4, 8, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def targets(x: torch.Tensor) -> torch.Tensor:
    """Class labels (3 classes) for the cross-entropy of the "lp" plan, a function of the batch."""
    return (x.sum(-1) * 7).floor().long().remainder(3)


def forward_backward(model: nn.Module, x: torch.Tensor, plan: str = "basic") -> torch.Tensor:
    """The loss of ``x`` with its backward run: "lp" takes the cross-entropy under
    ``loss_parallel()`` (on the sharded logits), the others ``loss_of``."""
    if plan != "lp":
        loss = loss_of(model, x)
        loss.backward()
        return loss
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(x)
    if not isinstance(logits, DTensor):  # the unsplit model: the same cross-entropy, whole
        loss = nn.functional.cross_entropy(logits, targets(x))
        loss.backward()
        return loss
    with loss_parallel():
        loss = nn.functional.cross_entropy(logits, targets(x))
        loss.backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def gather_tp(t: torch.Tensor, dim: int, tp_group) -> torch.Tensor:
    parts = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(parts, t.detach().cpu(), group=tp_group)
    return torch.cat(parts, dim=dim)


def slice_of(whole: torch.Tensor, dim: int, tp_group) -> torch.Tensor:
    """This TP rank's fragment of ``whole`` (DTensor's Shard: torch.chunk)."""
    return whole.chunk(dist.get_world_size(tp_group), dim=dim)[dist.get_rank(tp_group)]


def dp_mean(g: torch.Tensor, dp_group) -> torch.Tensor:
    """The data-parallel mean, summed in data-parallel rank order."""
    n = dist.get_world_size(dp_group)
    parts = [torch.empty_like(g) for _ in range(n)]
    dist.all_gather(parts, g.contiguous(), group=dp_group)
    total = parts[0].clone()
    for x in parts[1:]:
        total.add_(x)
    return total / n


def local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of ``p``'s gradient in ``p``'s placements: with sequence parallelism a
    replicated parameter's gradient comes back ``Partial`` (each TP rank's rows), summed over TP here."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(placements=p.placements)
    return local(g)


class Reference:
    """The plain reference run (see the module docstring) on a (data_parallel, tensor_parallel) mesh."""

    def __init__(self, mesh, blockwise: bool = False, seed: int = 0, plan: str = "basic", frozen=(),
                 zero_missing: bool = False) -> None:
        torch.manual_seed(seed)
        self.plan, self.zero_missing = plan, zero_missing
        self.model = parallelize(Net(), mesh["tensor_parallel"], plan, frozen)
        self.tp, self.dp = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_group()
        self.blockwise = blockwise
        self.mirrors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            dim = split_dim(name, plan)
            t = local(p).detach()
            self.mirrors[name] = (gather_tp(t, dim, self.tp) if dim is not None and not blockwise else t).clone()
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        mats = [m for n, m in self.mirrors.items() if m.ndim == 2 and n in trained]
        rest = [m for n, m in self.mirrors.items() if m.ndim != 2 and n in trained]
        self.opts = [torch.optim.Muon(mats, **MUON_DEFAULTS), torch.optim.AdamW(rest, **ADAMW_DEFAULTS)]

    def step(self, x, micro: int = 1) -> float:
        """One optimizer step on ``x`` (or on each of ``micro`` batches in the list ``x``, every
        micro-batch's DP mean added up as the sharded run's reductions add them)."""
        xs = x if micro > 1 else [x]
        grads: dict[str, torch.Tensor] = {}
        for xb in xs:
            loss = forward_backward(self.model, xb, self.plan)
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    continue
                mine = local_grad(p) if p.grad is not None else torch.zeros_like(local(p).detach())
                assert p.grad is not None or self.zero_missing, f"{name} has no gradient"
                g = dp_mean(mine, self.dp)
                grads[name] = g if name not in grads else grads[name].add_(g)
                p.grad = None
        for name in grads:
            dim = split_dim(name, self.plan)
            g = grads[name]
            self.mirrors[name].grad = gather_tp(g, dim, self.tp) if dim is not None and not self.blockwise else g
        for o in self.opts:
            o.step()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                m, dim = self.mirrors[name], split_dim(name, self.plan)
                local(p).copy_(slice_of(m, dim, self.tp) if dim is not None and not self.blockwise else m)
        return loss.item()

    def whole_grads(self, x) -> list:
        """The DP-mean gradients of one batch, whole (split ones gathered), in parameter order."""
        loss_of(self.model, x).backward()
        out = []
        for name, p in self.model.named_parameters():
            dim = split_dim(name) if split_dim(name) is not None else SPLIT_BIAS.get(name.split(".", 2)[-1])
            g = dp_mean(local(p.grad), self.dp)
            out.append(gather_tp(g, dim, self.tp) if dim is not None else g)
            p.grad = None
        return out

    def fragment(self, name: str) -> torch.Tensor:
        return local(dict(self.model.named_parameters())[name]).detach()


class Unsplit:
    """The unsplit model trained as one process would train it on every data-parallel rank's
    batch (the DP mean of whole gradients, ``torch.optim.Muon`` / ``AdamW`` on whole tensors):
    the TP run differs from it only by the order of the float operations TP splits."""

    def __init__(self, mesh, seed: int = 0, plan: str = "basic") -> None:
        torch.manual_seed(seed)
        self.model, self.plan = Net(), plan
        self.dp = mesh["data_parallel"].get_group()
        params = list(self.model.parameters())
        self.opts = [torch.optim.Muon([p for p in params if p.ndim == 2], **MUON_DEFAULTS),
                     torch.optim.AdamW([p for p in params if p.ndim != 2], **ADAMW_DEFAULTS)]

    def step(self, x: torch.Tensor) -> float:
        loss = forward_backward(self.model, x, self.plan)
        for p in self.model.parameters():
            p.grad = dp_mean(p.grad, self.dp)
        for o in self.opts:
            o.step()
            o.zero_grad()
        return loss.item()

    def fragment(self, name: str, tp_group) -> torch.Tensor:
        """The slice of the whole parameter that TP rank holds (whole where TP does not split it)."""
        whole = dict(self.model.named_parameters())[name].detach()
        dim = whole_dim(name, self.plan)
        return whole if dim is None else slice_of(whole, dim, tp_group)
