"""Tensor-parallel test helpers: a tiny model with every kind of split, its TP plan, and the
plain reference the sharded runs are held to (independent of the runtime).

The reference is data parallel plus the *same* TP plan: the model is parallelized as in the
sharded run (so forward and backward are the same float operations), each local gradient is
averaged over the data-parallel ranks in rank order, and every TP-split matrix is gathered
whole over the TP group and stepped by ``torch.optim.Muon`` on the whole matrix; every rank
keeps its slice. ``blockwise=True`` steps each fragment alone instead (the negative control:
Megatron's blockwise mode, whose update depends on the TP size).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

#: split matrices of a block: name -> the dimension ``parallelize_module`` splits
SPLIT = {"qkv.weight": 0, "proj.weight": 1, "up.weight": 0, "down.weight": 1}
#: split biases (the colwise layers'): AdamW steps them where they are, the norm gathers them
SPLIT_BIAS = {"qkv.bias": 0, "up.bias": 0}


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(torch.tanh(self.qkv(self.norm(x))))
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


def parallelize(model: Net, tp_mesh) -> Net:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                        "up": ColwiseParallel(output_layouts=Replicate()),
                                        "down": RowwiseParallel(input_layouts=Replicate())})
    return model


def split_dim(name: str):
    return SPLIT.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None


def batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 17 * step + dp_rank)
    return torch.randn(4, 8, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


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


class Reference:
    """The plain reference run (see the module docstring) on a (data_parallel, tensor_parallel) mesh."""

    def __init__(self, mesh, blockwise: bool = False, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = parallelize(Net(), mesh["tensor_parallel"])
        self.tp, self.dp = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_group()
        self.blockwise = blockwise
        self.mirrors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            dim = split_dim(name)
            t = local(p).detach()
            self.mirrors[name] = (gather_tp(t, dim, self.tp) if dim is not None and not blockwise else t).clone()
        mats = [m for n, m in self.mirrors.items() if m.ndim == 2]
        rest = [m for n, m in self.mirrors.items() if m.ndim != 2]
        self.opts = [torch.optim.Muon(mats, **MUON_DEFAULTS), torch.optim.AdamW(rest, **ADAMW_DEFAULTS)]

    def step(self, x, micro: int = 1) -> float:
        """One optimizer step on ``x`` (or on each of ``micro`` batches in the list ``x``, every
        micro-batch's DP mean added up as the sharded run's reductions add them)."""
        xs = x if micro > 1 else [x]
        grads: dict[str, torch.Tensor] = {}
        for xb in xs:
            loss = loss_of(self.model, xb)
            loss.backward()
            for name, p in self.model.named_parameters():
                g = dp_mean(local(p.grad), self.dp)
                grads[name] = g if name not in grads else grads[name].add_(g)
                p.grad = None
        for name in grads:
            dim = split_dim(name)
            g = grads[name]
            self.mirrors[name].grad = gather_tp(g, dim, self.tp) if dim is not None and not self.blockwise else g
        for o in self.opts:
            o.step()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                m, dim = self.mirrors[name], split_dim(name)
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

    def __init__(self, mesh, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Net()
        self.dp = mesh["data_parallel"].get_group()
        params = list(self.model.parameters())
        self.opts = [torch.optim.Muon([p for p in params if p.ndim == 2], **MUON_DEFAULTS),
                     torch.optim.AdamW([p for p in params if p.ndim != 2], **ADAMW_DEFAULTS)]

    def step(self, x: torch.Tensor) -> float:
        loss = loss_of(self.model, x)
        loss.backward()
        for p in self.model.parameters():
            p.grad = dp_mean(p.grad, self.dp)
        for o in self.opts:
            o.step()
            o.zero_grad()
        return loss.item()

    def fragment(self, name: str, tp_group) -> torch.Tensor:
        """The slice of the whole parameter that TP rank holds (whole where TP does not split it)."""
        whole = dict(self.model.named_parameters())[name].detach()
        dim = split_dim(name) if split_dim(name) is not None else SPLIT_BIAS.get(name.split(".", 2)[-1])
        return whole if dim is None else slice_of(whole, dim, tp_group)
