"""Scenarios of ``test_tensor_parallel.py``'s launch for "everything else keeps working with TP
on": ``zero_missing_grads`` and frozen parameters, sequence parallelism and loss parallelism in
the plan, ``torch.compile`` of blocks, ``grad_norm``, the plan printout and the byte counters,
the TP group's digest check. Each returns plain values for the tests; the oracle is the plain
reference of ``tp_reference.py`` (the same plan, DP mean, whole-matrix ``torch.optim.Muon``)."""
from __future__ import annotations

import logging

import torch

from helpers.tp_reference import Net, Reference, Unsplit, batch, forward_backward, gather_tp, parallelize, whole_dim

#: frozen by the "frozen" scenario: a colwise-split matrix, a rowwise-split one, a TP-replicated
#: matrix, a split bias and a replicated one
FROZEN = ("blocks.0.qkv.weight", "blocks.1.down.weight", "blocks.1.gate.weight", "blocks.0.up.bias",
          "blocks.1.norm.bias")


def skip_schedule(step: int, dp_rank: int) -> frozenset:
    """The blocks whose MLP (``up``/``down``: split matrices and biases) data-parallel rank
    ``dp_rank`` leaves out at ``step``: step 1 block 1 on DP rank 1, step 2 block 0 on DP rank 0,
    step 3 block 1 on both; step 0 uses everything. Both TP ranks of a DP rank skip alike (the TP
    collectives of a layer need them all); a whole unit skipped on some ranks is refused with or
    without TP (``RankDivergenceError``)."""
    return {(1, 1): frozenset({1}), (2, 0): frozenset({0}), (3, 0): frozenset({1}),
            (3, 1): frozenset({1})}.get((step % 4, dp_rank), frozenset())


def _apply_skips(model, step: int, dp_rank: int) -> None:
    mlps = skip_schedule(step, dp_rank)
    for i, b in enumerate(model.blocks):
        b.skip_mlp = i in mlps


def _compile_blocks(model) -> list:
    """The first block's forward through ``torch.compile`` with AOTAutograd and eager kernels
    (``aot_eager``: inductor's C++ build takes ~25 s even for a tiny graph on the CI box; one
    block: tracing costs ~2 s of CPU per block and rank); the unit's hooks stay outside the
    compiled region, as with FSDP2's per-block compile. Returns a list that gets one entry per
    graph compiled (recompilations included)."""
    from torch._dynamo import lookup_backend

    graphs: list = []
    aot_eager = lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    b = model.blocks[0]
    b.forward = torch.compile(b.forward, backend=counting, dynamic=False)
    return graphs


def run(mesh, steps: int, plan: str = "basic", frozen=(), skips: bool = False, compiled: bool = False,
        unsplit: bool = False, **options) -> dict:
    """``steps`` Muon steps of the sharded TP model against the reference with the same options:
    losses and every held fragment bitwise, frozen weights unchanged; ``unsplit``: the largest
    difference to one-process training of the unsplit model at the end."""
    import lightning_matrixfsdp as mf
    from helpers.tp_scenarios import _ours

    dp_rank, tp = mesh["data_parallel"].get_local_rank(), mesh["tensor_parallel"].get_group()
    torch.manual_seed(0)
    model = parallelize(Net(), mesh["tensor_parallel"], plan, frozen)
    graphs = _compile_blocks(model) if compiled else None
    mf.matrix_shard(model, mesh=mesh, zero_missing_grads=skips, **options)
    opt = _ours("muon", list(model.parameters()))
    ref = Reference(mesh, plan=plan, frozen=frozen, zero_missing=skips)  # eager
    whole = Unsplit(mesh, plan=plan) if unsplit else None
    start = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    out = {"loss_equal": True, "weights_equal": True, "losses": [], "bad": []}
    for step in range(steps):
        x = batch(step, dp_rank)
        if skips:
            _apply_skips(model, step, dp_rank)
            _apply_skips(ref.model, step, dp_rank)
        loss = forward_backward(model, x, plan)
        opt.step()
        opt.zero_grad()
        want = ref.step(x)
        if whole is not None:
            whole.step(x)
        got = loss.item()
        out["losses"].append(got)
        out["loss_equal"] &= got == want
        for n, p in model.named_parameters():
            if p.numel() and not torch.equal(p.detach(), ref.fragment(n)):
                out["weights_equal"] = False
                out["bad"].append((step, n, (p.detach() - ref.fragment(n)).abs().max().item()))
    out["frozen_unchanged"] = all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters()
                                  if n in frozen)
    out["frozen_held"] = sum(1 for n, p in model.named_parameters() if n in frozen and p.numel())
    if graphs is not None:
        out["graphs"] = len(graphs)
    if whole is not None:
        out["unsplit_max_diff"] = max((p.detach() - whole.fragment(n, tp)).abs().max().item()
                                      for n, p in model.named_parameters() if p.numel())
    return out


class TextHandler(logging.Handler):
    """Keeps every line logged through it (the plan printed at setup)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


def grad_norms(mesh) -> dict:
    """``grad_norm(module, norm_type)`` with TP against Lightning's keys and values computed plainly
    on the whole (TP-gathered, DP-mean) gradients, for norm types 2, 1 and inf; a frozen matrix
    has no key."""
    import lightning_matrixfsdp as mf

    dp_rank = mesh["data_parallel"].get_local_rank()
    torch.manual_seed(0)
    model = parallelize(Net(), mesh["tensor_parallel"], frozen=("blocks.1.gate.weight",))
    mf.matrix_shard(model, mesh=mesh)
    ref = Reference(mesh, frozen=("blocks.1.gate.weight",))
    x = batch(0, dp_rank)
    forward_backward(model, x)
    forward_backward(ref.model, x)
    out = {}
    for norm_type in (2, 1, "inf"):
        got = mf.grad_norm(model, norm_type)
        p = float(norm_type)
        want = {}
        for name, q in ref.model.named_parameters():
            if q.grad is None:
                continue
            g = _dp_mean(q.grad, mesh)
            dim = whole_dim(name)
            g = gather_tp(g, dim, mesh["tensor_parallel"].get_group()) if dim is not None else g
            want[f"grad_{p}_norm/{name}"] = g.norm(p)
        want[f"grad_{p}_norm_total"] = torch.tensor(list(want.values())).norm(p)
        out[str(norm_type)] = {"keys": sorted(got) == sorted(want),
                               "max_rel": max((got[k] - want[k]).abs().item() / want[k].abs().item()
                                              for k in want if k in got),
                               "got": {k: v.item() for k, v in got.items()}}
    return out


def _dp_mean(g, mesh):
    from helpers.tp_reference import dp_mean, local

    return dp_mean(local(g), mesh["data_parallel"].get_group())


def digest_mismatch(mesh) -> str:
    """TP rank 1 of each TP group also parallelizes ``gate`` (colwise): the TP group's digest check
    refuses it before any collective of the runtime, on every rank, naming the TP group."""
    import lightning_matrixfsdp as mf
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = parallelize(Net(), mesh["tensor_parallel"])
    if mesh["tensor_parallel"].get_local_rank() == 1:  # no scatter from TP rank 0: TP rank 0 is not in it
        parallelize_module(model.blocks[1], mesh["tensor_parallel"], {"gate": ColwiseParallel()}, src_data_rank=None)
    try:
        mf.matrix_shard(model, mesh=mesh)
    except RuntimeError as e:
        return str(e)
    return "no error"


def scenarios(mesh) -> dict:
    """This file's scenarios, in an order every rank follows."""
    return {"zero_missing": run(mesh, 4, skips=True), "frozen": run(mesh, 3, frozen=FROZEN),
            "sequence_parallel": run(mesh, 3, plan="sp", unsplit=True),
            "loss_parallel": run(mesh, 3, plan="lp", unsplit=True),
            "compiled": run(mesh, 3, compiled=True), "grad_norm": grad_norms(mesh),
            "digest_mismatch": digest_mismatch(mesh)}
