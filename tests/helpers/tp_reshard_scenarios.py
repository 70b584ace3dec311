"""The scenarios of ``test_tp_reshard.py``: tensor-parallel checkpoints loaded at another mesh,
all in one 4-process launch (``worker``); the (2, 2) -> (1, 1) load runs in the test process.

The oracle is independent of the loader: the saving run's whole tensors (weights and optimizer
state) assembled with plain ``torch.distributed`` calls from what each rank holds (TP fragments
concatenated along the split dimension that ``parallelize_module`` gave the DTensor; whole-matrix
state taken from the one TP rank that holds it), compared with ``torch.equal``.

The model is ``tp_reference.Net`` with every matrix split: its head made ``Linear(8, 4)`` and split
rowwise, so that Shampoo's and SOAP's left factor of the head (4 x 4) has the shape of the head's
fragment (4 x 4), and each ``gate`` split colwise. (A matrix that TP replicates is stepped by every
TP rank on its own copy; with SOAP those copies drift apart by float rounding, since the library's
products on the gradient round by where the gradient sits in its buffer, which differs per TP
rank, so no checkpoint, which holds one copy, could resume them bitwise.)
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from helpers.oracle import allreduce_mean_grads, oracle_optimizers
from helpers.tp_reference import Net, batch, loss_of, parallelize
from helpers.tp_scenarios import _mesh, _ours, _train

#: optimizers of the reshard scenarios; whole-matrix state for all but Muon
KINDS = ("muon", "shampoo", "soap")


def model(mesh=None, head_rows: int = 4):
    """The test model, split over ``mesh['tensor_parallel']`` (None: no TP) and owner-sharded over the
    data-parallel ranks (without a mesh: over the world); and {name: split dim} read off the DTensors."""
    import lightning_matrixfsdp as mf
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = Net()
    net.head = torch.nn.Linear(8, head_rows)
    dims = {}
    if mesh is not None:
        parallelize(net, mesh["tensor_parallel"])
        plan = {"head": RowwiseParallel(input_layouts=Replicate())}
        plan.update({f"blocks.{i}.gate": ColwiseParallel(output_layouts=Replicate()) for i in range(len(net.blocks))})
        parallelize_module(net, mesh["tensor_parallel"], plan)
        dims = {n: p.placements[0].dim for n, p in net.named_parameters()
                if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)}
    mf.matrix_shard(net, mesh=mesh)
    return net, dims


def whole_kind(kind: str, p_ndim: int) -> bool:
    """Whether the optimizer keeps this parameter's state whole (Shampoo's and SOAP's matrices)."""
    return kind != "muon" and p_ndim == 2


def assemble(net, opt, dims, tp_group, kind) -> dict:
    """{name: (whole weight, whole state)} from what every rank holds, with plain torch.distributed."""
    t_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    mine = {n: (t_rank, p.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                             for k, v in opt.state.get(p, {}).items()})
            for n, p in net.named_parameters() if p.numel()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    full = {}
    for n, p in net.named_parameters():
        by_tp = {}
        for held in every:
            if n in held:
                by_tp.setdefault(held[n][0], held[n][1:])
        frags = [by_tp[t] for t in sorted(by_tp)]
        dim = dims.get(n)
        if dim is None:  # whole on its owner (TP-replicated: every TP rank the same)
            full[n] = frags[0]
            continue
        weight = torch.cat([w for w, _ in frags], dim)
        if whole_kind(kind, weight.ndim):
            holders = [s for _, s in frags if s]
            assert len(holders) == 1, (n, len(holders))  # the TP stepper alone
            full[n] = (weight, holders[0])
            continue
        state = {k: (torch.cat([s[k] for _, s in frags], dim) if isinstance(v, torch.Tensor) and v.ndim else v)
                 for k, v in frags[0][1].items()}
        full[n] = (weight, state)
    return full


def compare(net, opt, full, dims, tp_group, kind) -> dict:
    """Every tensor this rank holds against the oracle's slice (weights, fragment state) or whole
    (whole state, on the one TP rank holding it); returns the differences and what holds state."""
    t_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    t_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    out = {"bad": [], "checked": 0, "holders": {}}

    def part(t, dim):
        return t.chunk(t_size, dim)[t_rank] if dim is not None and isinstance(t, torch.Tensor) and t.ndim else t

    for n, p in net.named_parameters():
        if not p.numel():
            continue
        dim = dims.get(n)
        weight, state = full[n]
        out["checked"] += 1
        if not torch.equal(p.detach(), part(weight, dim)):
            out["bad"].append((n, "weight"))
        ours = opt.state.get(p, {})
        if dim is not None and p.ndim == 2:
            out["holders"][n] = bool(ours)
        whole = whole_kind(kind, weight.ndim)
        if whole and dim is not None and not ours:
            continue  # another TP rank holds it: the test counts the holders
        if set(ours) != set(state):
            out["bad"].append((n, "state keys", sorted(ours), sorted(state)))
            continue
        for k, v in state.items():
            out["checked"] += 1
            want = v if whole else part(v, dim)
            same = torch.equal(ours[k], want) if isinstance(v, torch.Tensor) else ours[k] == v
            if not same:
                out["bad"].append((n, f"state {k}"))
    return out


def _continued_step(net, opt, full) -> dict:
    """One more Muon step at (4, 1) after the (2, 2) -> (4, 1) load, against DDP Muon written plainly
    (tests/helpers/oracle.py) started from the oracle's whole weights and state."""
    plain = Net()
    plain.head = torch.nn.Linear(8, 4)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for n, q in params.items():
            q.copy_(full[n][0])
    oracles = oracle_optimizers(plain)
    for o in oracles:
        for q in o.param_groups[0]["params"]:
            name = next(n for n, x in params.items() if x is q)
            o.state[q] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in full[name][1].items()}
    x = batch(2, dist.get_rank())
    loss_of(plain, x).backward()
    allreduce_mean_grads(plain)
    for o in oracles:
        o.step()
    _train(net, opt, 1, dist.get_rank(), first=2)
    bad = [n for n, p in net.named_parameters() if p.numel() and not torch.equal(p.detach(), params[n].detach())]
    return {"bad": bad, "checked": sum(1 for p in net.parameters() if p.numel())}


def _resume(net, opt, path, mesh, kind) -> dict:
    """Same mesh: 2 more steps of the saving run against a fresh model loaded from ``path`` taking the
    same 2 steps; every weight and state tensor bitwise."""
    dp_rank = mesh["data_parallel"].get_local_rank()
    got, got_opt, _ = _load(path, mesh, kind)
    for m, o in ((net, opt), (got, got_opt)):
        _train(m, o, 2, dp_rank, first=2)
    bad, checked = [], 0
    for (n, p), q in zip(net.named_parameters(), got.parameters()):
        a, b = opt.state.get(p, {}), got_opt.state.get(q, {})
        checked += 1 + len(a)
        if not torch.equal(p.detach(), q.detach()) or set(a) != set(b):
            bad.append((n, "weight or state keys"))
            continue
        bad += [(n, k) for k, v in a.items()
                if not (torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k])]
    return {"bad": bad, "checked": checked}


def _load(path, mesh, kind):
    from lightning_matrixfsdp.checkpoint import load_sharded

    net, dims = model(mesh)
    opt = _ours(kind, list(net.parameters()))
    load_sharded(net, path, [opt])
    return net, opt, dims


def _reshard(kind: str, mesh, mesh14, root: Path) -> dict:
    """(2, 2) -> (4, 1) and (1, 4) (``mesh14``), then (4, 1) -> (2, 2) from the directory and
    from a consolidated file."""
    from lightning_matrixfsdp.checkpoint import save_sharded

    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    net, dims = model(mesh)
    opt = _ours(kind, list(net.parameters()))
    _train(net, opt, 2, dp_rank)
    save_sharded(net, root / f"{kind}22", [opt])
    full22 = assemble(net, opt, dims, tp, kind)
    if dist.get_rank() == 0:  # for the (2, 2) -> (1, 1) load in the test process
        torch.save(full22, root / f"{kind}22.oracle.pt")
    out = {"resume": _resume(net, opt, root / f"{kind}22", mesh, kind)}
    net41, opt41, _ = _load(root / f"{kind}22", None, kind)
    out["22_to_41"] = compare(net41, opt41, full22, {}, None, kind)
    net14, opt14, dims14 = _load(root / f"{kind}22", mesh14, kind)
    out["22_to_14"] = compare(net14, opt14, full22, dims14, mesh14["tensor_parallel"].get_group(), kind)
    if kind == "muon":
        out["continued_step"] = _continued_step(net41, opt41, full22)
    else:
        _train(net41, opt41, 1, dist.get_rank(), first=2)
    save_sharded(net41, root / f"{kind}41", [opt41])
    save_sharded(net41, root / f"{kind}41.ckpt", [opt41], full=True)  # a consolidated file (no TP)
    full41 = assemble(net41, opt41, {}, None, kind)
    for src, name in ((f"{kind}41", "41_to_22"), (f"{kind}41.ckpt", "file_to_22")):
        got, got_opt, got_dims = _load(root / src, mesh, kind)
        out[name] = compare(got, got_opt, full41, got_dims, tp, kind)
    return out


def _errors(mesh, root: Path) -> dict:
    """Wrong inputs: a split of another global shape; fragment state of the wrong shape in a file,
    loaded into (2, 2), and loaded into (4, 1) when the file records the key as split at the save;
    a save of per-fragment state that cannot be joined (Adafactor over TP-split matrices)."""
    from lightning_matrixfsdp.checkpoint import CheckpointMismatchError, load_sharded

    out = {}
    other, _ = model(mesh, head_rows=6)
    try:  # the saved head is (4, 8); this run's is (6, 8), split the same way
        load_sharded(other, root / "muon22", [_ours("muon", list(other.parameters()))])
        out["global_shape"] = "no error"
    except CheckpointMismatchError as e:
        out["global_shape"] = str(e)
    if dist.get_rank() == 0:  # the file with one split matrix's momentum cut to a fragment
        ck = torch.load(root / "muon41.ckpt", weights_only=False)
        opt_state = ck["optimizer_states"][0]
        names = [n for g in opt_state["param_groups"] for n in g["param_names"]]
        pid = names.index("blocks.0.qkv.weight")
        buf = opt_state["state"][pid]["momentum_buffer"]
        opt_state["state"][pid]["momentum_buffer"] = buf[: buf.shape[0] // 2].clone()
        torch.save(ck, root / "bad.ckpt")
        # the same, recorded as split at the save (a state written per fragment), loaded without TP
        ck["matrix_fsdp_layout"]["params"]["blocks.0.qkv.weight"]["tp"] = {"dim": 0, "global_shape": [24, 8],
                                                                           "sizes": [12, 12]}
        torch.save(ck, root / "bad_saved_split.ckpt")
    dist.barrier()
    for name, target in (("fragment_state", mesh), ("saved_split", None)):
        try:
            _load(root / ("bad.ckpt" if target is not None else "bad_saved_split.ckpt"), target, "muon")
            out[name] = "no error"
        except CheckpointMismatchError as e:
            out[name] = str(e)
    # an optimizer of another package with per-fragment state that is not elementwise (Adafactor's
    # row and column factors): the save refuses it on every rank instead of keeping one TP rank's
    import warnings

    from lightning_matrixfsdp.checkpoint import CheckpointError, save_sharded

    net, _ = model(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # routing warns that it steps each fragment alone
        opt = torch.optim.Adafactor(list(net.parameters()), lr=0.01)
        _train(net, opt, 1, mesh["data_parallel"].get_local_rank())
    for full in (False, True):
        try:
            save_sharded(net, root / ("adafactor.ckpt" if full else "adafactor"), [opt], full=full)
            out[f"adafactor_full={full}"] = "no error"
        except CheckpointError as e:
            out[f"adafactor_full={full}"] = str(e)
    return out


def worker(rank: int, world: int, root: str) -> dict:
    """Every scenario on one rank, in an order every rank follows; ``root``: a directory all share."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = _mesh()
    mesh14 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("data_parallel", "tensor_parallel"))
    root = Path(root)
    res = {kind: _reshard(kind, mesh, mesh14, root) for kind in KINDS}
    res["errors"] = _errors(mesh, root)
    return res


def load_at_one_process(root: str, kind: str) -> dict:
    """(2, 2) -> (1, 1): this process alone (no process group) loads the directory; every tensor
    against the oracle the saving run wrote."""
    net, opt, _ = _load(Path(root) / f"{kind}22", None, kind)
    full = torch.load(Path(root) / f"{kind}22.oracle.pt", weights_only=False)
    bad, checked = [], 0
    for n, p in net.named_parameters():
        weight, state = full[n]
        checked += 1
        if not torch.equal(p.detach(), weight):
            bad.append((n, "weight"))
        ours = opt.state.get(p, {})
        if set(ours) != set(state):
            bad.append((n, "state keys", sorted(ours), sorted(state)))
            continue
        for k, v in state.items():
            checked += 1
            if not (torch.equal(ours[k], v) if isinstance(v, torch.Tensor) else ours[k] == v):
                bad.append((n, f"state {k}"))
    return {"bad": bad, "checked": checked}
