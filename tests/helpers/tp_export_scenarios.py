"""The scenarios of ``test_tp_export.py``'s one 4-process launch (world 4 = D 2 x T 2, gloo,
float32): a TP model's whole weights and whole-matrix optimizer state in the consolidated file,
the offline consolidation of its checkpoint directory, the safetensors export and ``full_model``.

The oracle is assembled here with plain ``torch.distributed``: every rank gathers the
fragments it holds over its TP group (``all_gather_object``) and concatenates them along the
split dimension; state held by one TP rank alone (Shampoo's whole-matrix state on the TP
stepper) is taken as that rank holds it; every rank's pieces are then collected on every rank.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.tp_reference import SPLIT_BIAS, Net, batch, parallelize, slice_of, split_dim
from helpers.tp_scenarios import _mesh, _ours, _sharded, _train


def _net(wide: bool) -> Net:
    """The test model; ``wide``: its MLP 8 -> 16 -> 8, so a TP fragment of ``up`` / ``down`` (8 x 8)
    has the shape of one of Shampoo's preconditioners of the whole matrix (whole-matrix state that
    must not be taken for a fragment)."""
    torch.manual_seed(0)
    net = Net()
    if wide:
        for b in net.blocks:
            b.up, b.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    return net


def _tp_model(mesh, wide: bool):
    import lightning_matrixfsdp as mf

    if not wide:
        return _sharded(mesh)
    return mf.matrix_shard(parallelize(_net(True), mesh["tensor_parallel"]), mesh=mesh)


def _dim(name: str):
    """The dimension TP splits parameter ``name`` along (None: replicated)."""
    d = split_dim(name)
    return d if d is not None else (SPLIT_BIAS.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None)


def _oracle(model, opt, tp) -> tuple[dict, dict]:
    """({name: whole weight}, {name: {state name: whole value}}), the same on every rank."""
    weights, states = {}, {}
    for n, p in model.named_parameters():  # the same order on every rank; TP peers hold the same names
        if not p.numel():
            continue
        dim = _dim(n)
        pieces = [None] * dist.get_world_size(tp)
        mine = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
        dist.all_gather_object(pieces, (p.detach().clone(), mine), group=tp)
        frags, held = [w for w, _ in pieces], [s for _, s in pieces]
        weights[n] = torch.cat(frags, dim) if dim is not None else frags[0]
        if dim is None or sum(bool(s) for s in held) == 1:  # whole (or held whole by one TP rank)
            whole = next((s for s in held if s), {})
        else:
            whole = {k: (torch.cat([s[k] for s in held], dim)
                         if isinstance(v, torch.Tensor) and v.ndim and tuple(v.shape) == tuple(p.shape) else v)
                     for k, v in held[0].items()}
        if whole:
            states[n] = whole
    collected = [None] * dist.get_world_size()
    dist.all_gather_object(collected, (weights, states))
    out_w, out_s = {}, {}
    for w, s in collected:  # lowest rank first
        for n, t in w.items():
            out_w.setdefault(n, t)
        for n, t in s.items():
            out_s.setdefault(n, t)
    return out_w, out_s


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _check_file(ck: dict, weights: dict, states: dict, what: str) -> list:
    """A consolidated checkpoint ({"state_dict", "optimizer_states"}) against the oracle."""
    bad = []
    sd = ck["state_dict"]
    want_keys = list(Net().state_dict())
    if list(sd) != want_keys:
        bad.append((what, "keys", list(sd), want_keys))
    for n, t in weights.items():
        if not _same(sd.get(n), t):
            bad.append((what, n, "weight"))
    if "optimizer_states" in ck:
        opt = ck["optimizer_states"][0]
        names = {i: n for g in opt["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        got = {names[i]: s for i, s in opt["state"].items()}
        if set(got) != set(states):
            bad.append((what, "state keys", sorted(got), sorted(states)))
        for n, s in states.items():
            g = got.get(n, {})
            if set(g) != set(s):
                bad.append((what, n, "state names", sorted(g), sorted(s)))
            bad += [(what, n, f"state {k}") for k, v in s.items() if not _same(g.get(k), v)]
    return bad


def _checkpoints(mesh, kind: str, root: Path, wide: bool = False) -> dict:
    """2 steps of ``kind``; the consolidated file of the live TP model, the consolidate command's file
    of its directory and the safetensors exports of both, against the oracle; the file loads into a
    model without TP (D 4 x T 1) and saves back the same."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import load_sharded, save_sharded
    from lightning_matrixfsdp.checkpoint.export import export_safetensors
    from lightning_matrixfsdp.consolidate import main as consolidate

    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    model = _tp_model(mesh, wide)
    opt = _ours(kind, list(model.parameters()))
    _train(model, opt, 2, dp_rank)
    weights, states = _oracle(model, opt, tp)
    save_sharded(model, root / f"{kind}.ckpt", [opt], full=True)
    save_sharded(model, root / f"{kind}-dir", [opt])
    out = {"bad": [], "weights": len(weights), "states": sum(len(s) for s in states.values())}
    if wide:  # the directory resumes at the same mesh: whole-matrix state of a fragment's shape stays whole
        fresh = _tp_model(mesh, wide)
        fresh_opt = _ours(kind, list(fresh.parameters()))
        load_sharded(fresh, root / f"{kind}-dir", [fresh_opt])
        for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
            a, b = opt.state.get(p, {}), fresh_opt.state.get(q, {})
            same = set(a) == set(b) and all(_same(v, b[k]) for k, v in a.items())
            if not torch.equal(p.detach(), q.detach()) or not same:
                out["bad"].append(("resume", n))
    if dist.get_rank() == 0:
        ck = torch.load(root / f"{kind}.ckpt", weights_only=True)
        out["bad"] += _check_file(ck, weights, states, "file")
        consolidate([str(root / f"{kind}-dir"), str(root / f"{kind}-conv.ckpt")])
        conv = torch.load(root / f"{kind}-conv.ckpt", weights_only=True)
        out["bad"] += _check_file(conv, weights, states, "consolidate")
        out["file_mesh"] = ck["matrix_fsdp_layout"].get("mesh")
        out["conv_mesh"] = conv["matrix_fsdp_layout"].get("mesh")
        # and back to a directory: a one-writer sidecar, without the TP records of the run
        consolidate([str(root / f"{kind}-conv.ckpt"), str(root / f"{kind}-back")])
        side = json.loads((root / f"{kind}-back" / "matrix_fsdp_layout.json").read_text())
        out["back_tp"] = ["mesh"] * ("mesh" in side) + [k for k, v in side["params"].items() if "tp" in v]
        from safetensors.torch import load_file

        for src in (f"{kind}-dir", f"{kind}.ckpt"):
            export_safetensors(root / src, root / f"{src}-st")
            st = load_file(str(root / f"{src}-st" / "model.safetensors"))
            keys = list(Net().state_dict())  # in the model's order, as the check wants them
            out["bad"] += _check_file({"state_dict": {k: st[k] for k in keys if k in st}}, weights, {},
                                      f"safetensors of {src}")
            if set(st) != set(Net().state_dict()):
                out["bad"].append((f"safetensors of {src}", "names", sorted(st)))
    # the safetensors export back into a fresh TP model (each owner takes its fragment's slice)
    fresh = _tp_model(mesh, wide)
    mf.load_pretrained(fresh, root / f"{kind}-dir-st")
    for n, p in fresh.named_parameters():
        want = weights[n] if _dim(n) is None else slice_of(weights[n], _dim(n), tp)
        if p.numel() and not torch.equal(p.detach(), want):
            out["bad"].append(("pretrained into TP", n))
    # the file into a model without TP (owner sharding over all 4 ranks), then saved back
    plain = mf.matrix_shard(_net(wide))
    plain_opt = _ours(kind, list(plain.parameters()))
    load_sharded(plain, root / f"{kind}.ckpt", [plain_opt])
    for n, p in plain.named_parameters():
        if p.numel() and not torch.equal(p.detach(), weights[n]):
            out["bad"].append(("non-TP load", n, "weight"))
        for k, v in plain_opt.state.get(p, {}).items():
            if not _same(v, states[n][k]):
                out["bad"].append(("non-TP load", n, f"state {k}"))
    save_sharded(plain, root / f"{kind}-plain.ckpt", [plain_opt], full=True)
    if dist.get_rank() == 0:
        a = torch.load(root / f"{kind}.ckpt", weights_only=True)
        b = torch.load(root / f"{kind}-plain.ckpt", weights_only=True)
        out["format_diff"] = _differences(a, b)
    return out


def _differences(a: dict, b: dict) -> list:
    """Where two consolidated files' model and optimizer states differ (keys, order, values)."""
    diff = []
    if list(a["state_dict"]) != list(b["state_dict"]):
        diff.append(("state_dict keys", list(a["state_dict"]), list(b["state_dict"])))
    diff += [("weight", k) for k, v in b["state_dict"].items() if not _same(a["state_dict"].get(k), v)]
    oa, ob = a["optimizer_states"][0], b["optimizer_states"][0]
    for ga, gb in zip(oa["param_groups"], ob["param_groups"]):  # (torch's load fills in flags a group lacked)
        diff += [("param_groups", k, v, gb.get(k)) for k, v in ga.items() if gb.get(k) != v]
    if set(oa["state"]) != set(ob["state"]):
        diff.append(("state ids", sorted(oa["state"]), sorted(ob["state"])))
    for i, s in ob["state"].items():
        t = oa["state"].get(i, {})
        if set(t) != set(s):
            diff.append(("state names", i, sorted(t), sorted(s)))
        diff += [("state", i, k) for k, v in s.items() if not _same(t.get(k), v)]
    return diff


def _full_model(mesh) -> dict:
    """``full_model`` of the TP model on rank 0, then on every rank: plain whole tensors equal to the
    oracle's, and a forward there equal to the unsplit model's with the oracle's weights; afterwards
    the model is TP-sharded again and trains on."""
    import lightning_matrixfsdp as mf
    from torch.distributed.tensor import DTensor

    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    model = _sharded(mesh)
    opt = _ours("muon", list(model.parameters()))
    _train(model, opt, 2, dp_rank)
    weights, _ = _oracle(model, opt, tp)
    unsplit = Net()
    unsplit.load_state_dict(weights)
    x = batch(7, 0)
    want = unsplit(x).detach()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {"bad": [], "checked": 0}
    for rank in (0, None):
        with mf.full_model(model, rank=rank) as m:
            if rank is None or dist.get_rank() == rank:
                for n, p in m.named_parameters():
                    out["checked"] += 1
                    if isinstance(p, DTensor) or not torch.equal(p.detach(), weights[n]):
                        out["bad"].append((rank, n, "weight"))
                if not torch.equal(m(x), want):
                    out["bad"].append((rank, "forward", (m(x) - want).abs().max().item()))
                import io

                buf = io.BytesIO()
                torch.save(m, buf)  # a plain module there: it pickles, and the copy runs alone too
                buf.seek(0)
                if not torch.equal(torch.load(buf, weights_only=False)(x), want):
                    out["bad"].append((rank, "pickled copy"))
    if {n: tuple(p.shape) for n, p in model.named_parameters()} != shapes:
        out["bad"].append(("shapes after the block",))
    _train(model, opt, 1, dp_rank, first=2)  # the TP hooks and the runtime are back
    return out


def _hsdp(mesh, root: Path) -> dict:
    """HSDP with TP ((replicate 2 x shard 1) x TP 2): the consolidated file and ``full_model``."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import save_sharded

    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    from lightning_matrixfsdp.runtime import sync_replicas

    model = _sharded(mesh, shard_size=1)
    opt = _ours("muon", list(model.parameters()))
    _train(model, opt, 2, dp_rank)
    sync_replicas(model)  # replica_split: the stepping replica's weights reach the other one
    weights, states = _oracle(model, opt, tp)
    save_sharded(model, root / "hsdp.ckpt", [opt], full=True)
    out = {"bad": [], "weights": len(weights), "states": sum(len(s) for s in states.values())}
    if dist.get_rank() == 0:
        out["bad"] += _check_file(torch.load(root / "hsdp.ckpt", weights_only=True), weights, states, "file")
    with mf.full_model(model, rank=0) as m:
        if dist.get_rank() == 0:
            out["bad"] += [("full_model", n) for n, p in m.named_parameters()
                           if not torch.equal(p.detach(), weights[n])]
    return out


def worker(rank, world):
    mesh = _mesh()
    holder = [tempfile.mkdtemp(prefix="tp-export-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    res = {"muon": _checkpoints(mesh, "muon", root), "shampoo": _checkpoints(mesh, "shampoo", root, wide=True),
           "full_model": _full_model(mesh), "hsdp": _hsdp(mesh, root)}
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return res
