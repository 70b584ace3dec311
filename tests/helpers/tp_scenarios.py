"""The scenarios of ``test_tensor_parallel.py``'s one 4-process launch (``_worker``), each
returning plain values for the tests to check; see that file's docstring for what each shows."""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.equiv import count_collectives
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS
from helpers.tp_reference import Net, Reference, Unsplit, batch, gather_tp, loss_of, parallelize, slice_of, split_dim

SHAMPOO = dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1, use_svd=True,
               block_size=512, shape_interpretation=False, betas=(0.9, 0.999), weight_decay=0.0,
               moving_average_for_momentum=False, decoupled_weight_decay=False, decoupled_learning_rate=True,
               nesterov=True, statistics_compute_steps=1, inverse_exponent_override=0,
               skip_preconditioning_rank_lt=1, no_preconditioning_for_layers_with_dim_gt=8192,
               diagonal_eps=1e-10, matrix_eps=1e-6)
SOAP = dict(lr=3e-3, betas=(0.95, 0.95), shampoo_beta=None, weight_decay=1e-2, precondition_frequency=1,
            max_precondition_dim=10000, correct_bias=True, normalize_gradient=False, eps=1e-8)


#: largest elementwise difference allowed after a few steps (8 for the trajectory) between the TP run and
#: one-process training of the unsplit model (TP sums the rowwise products in another order;
#: Newton-Schulz runs in bfloat16)
UNSPLIT_TOLERANCE = 1e-2


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _sharded(mesh, checkpointing: bool = False, **options):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.adapters.shared import apply_activation_checkpointing
    from helpers.tp_reference import Block

    torch.manual_seed(0)
    model = parallelize(Net(), mesh["tensor_parallel"])
    if checkpointing:
        apply_activation_checkpointing(model, {Block})
    mf.matrix_shard(model, mesh=mesh, **options)
    return model


def _clip(mesh) -> dict:
    """Global-norm clipping over both groups against torch's norm of the whole DP-mean gradients."""
    import lightning_matrixfsdp as mf

    dp_rank = mesh["data_parallel"].get_local_rank()
    model, ref = _sharded(mesh), Reference(mesh)
    x = batch(0, dp_rank)
    loss_of(model, x).backward()
    whole = ref.whole_grads(x)
    want = torch.nn.utils.get_total_norm(whole)
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    total = mf.clip_grad_norm_(model, 0.05)
    coef = min(0.05 / (want.item() + 1e-6), 1.0)
    scaled = all(torch.allclose(p.grad, before[n] * coef, rtol=1e-6, atol=0)
                 for n, p in model.named_parameters() if p.grad is not None)
    # A list of the parameters with only the norm group (what the strategies' clips pass): the clip
    # finds the TP group from the TP fragments among them.
    from lightning_matrixfsdp.runtime import norm_groups

    for n, p in model.named_parameters():
        if p.grad is not None:
            p.grad.copy_(before[n])
    listed = mf.clip_grad_norm_(list(model.parameters()), 0.05, group=norm_groups(model).group)
    list_scaled = all(torch.allclose(p.grad, before[n] * coef, rtol=1e-6, atol=0)
                      for n, p in model.named_parameters() if p.grad is not None)
    return {"total": total.item(), "want": want.item(), "scaled": scaled, "clipped": coef < 1,
            "list_total": listed.item(), "list_scaled": list_scaled}


def _refusals(mesh) -> dict:
    """What matrix_shard refuses before any collective: the messages, per case."""
    import lightning_matrixfsdp as mf
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    out = {}
    for case in ("partial", "2d"):
        torch.manual_seed(0)
        model = parallelize(Net(), mesh["tensor_parallel"])
        w = model.head.weight
        if case == "partial":
            model.head.weight = torch.nn.Parameter(DTensor.from_local(w.detach(), mesh["tensor_parallel"], [Partial()]))
        else:
            model.head.weight = torch.nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0), Shard(1)]))
        try:
            mf.matrix_shard(model, mesh=mesh)
            out[case] = "no error"
        except ValueError as e:
            out[case] = str(e)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # a matrix optimizer of another package
        warnings.simplefilter("always")
        mf.route_optimizer(torch.optim.Muon([p for p in _sharded(mesh).parameters() if p.ndim == 2], lr=0.02))
    out["torch_muon"] = " ".join(str(w.message) for w in caught)
    return out


def _train(model, opt, steps, dp_rank, first: int = 0) -> None:
    for step in range(first, first + steps):
        loss_of(model, batch(step, dp_rank)).backward()
        opt.step()
        opt.zero_grad()


def _checkpoint(mesh, kind: str = "muon", other_mesh: bool = True) -> dict:
    """Save at (D, T) = (2, 2) after 2 steps, 2 more steps; a fresh model loads the save and runs the
    same 2 steps: weights and optimizer state bitwise the uninterrupted run's (``kind``: Muon's
    momentum as TP fragments; Shampoo's whole-matrix state on the TP stepper alone). The sidecar
    records the mesh and the TP layouts; the same directory with the sidecar's mesh changed loads
    (``other_mesh``: resharding, tested in test_tp_reshard.py)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from lightning_matrixfsdp.checkpoint import CheckpointMismatchError, load_sharded, save_sharded

    dp_rank = mesh["data_parallel"].get_local_rank()
    holder = [tempfile.mkdtemp(prefix="tp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    model = _sharded(mesh)
    opt = _ours(kind, list(model.parameters()))
    _train(model, opt, 2, dp_rank)
    save_sharded(model, root / "ck", [opt])
    _train(model, opt, 2, dp_rank, first=2)
    fresh = _sharded(mesh)
    fresh_opt = _ours(kind, list(fresh.parameters()))
    load_sharded(fresh, root / "ck", [fresh_opt])
    _train(fresh, fresh_opt, 2, dp_rank, first=2)
    out = {"weights": 0, "states": 0, "bad": []}
    ours, theirs = dict(model.named_parameters()), dict(fresh.named_parameters())
    for n, p in ours.items():
        q = theirs[n]
        out["weights"] += 1
        if not torch.equal(p.detach(), q.detach()):
            out["bad"].append((n, "weight"))
        a, b = opt.state.get(p, {}), fresh_opt.state.get(q, {})
        if set(a) != set(b):
            out["bad"].append((n, "state keys", sorted(a), sorted(b)))
        for k, v in a.items():
            out["states"] += 1
            same = torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b.get(k)
            if not same:
                out["bad"].append((n, f"state {k}"))
    side = json.loads((root / "ck" / "matrix_fsdp_layout.json").read_text())
    out["mesh"] = side.get("mesh")
    out["tp"] = {k: v["tp"] for k, v in side["params"].items() if "tp" in v}
    if not other_mesh:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        return out
    if dist.get_rank() == 0:  # the same data, recorded as saved at another mesh
        shutil.copytree(root / "ck", root / "other")
        side["mesh"] = {"data_parallel": 4, "tensor_parallel": 1}
        (root / "other" / "matrix_fsdp_layout.json").write_text(json.dumps(side))
    dist.barrier()
    try:
        load_sharded(_sharded(mesh), root / "other")
        out["other_mesh"] = "loaded"
    except CheckpointMismatchError as e:
        out["other_mesh"] = str(e)
    from lightning_matrixfsdp.checkpoint import CheckpointError, build_index, model_view

    def views(view, module):  # Lightning's views: this TP rank's fragment where owned, else empty
        bad = [k for k, p in module.named_parameters()
               if not (torch.equal(view[k], p.detach()) if p.numel() else view[k].numel() == 0)]
        return f"views {'wrong: ' + str(bad[:3]) if bad else 'ok'}"

    for case, call in (("file_save", lambda: save_sharded(model, root / "one.ckpt", [opt], full=True)),
                       ("lightning_save", lambda: views(model_view(build_index(model)), model)),
                       ("lightning_load", lambda: views(load_sharded(fresh, root / "ck", [fresh_opt],
                                                                     with_state_dict=True)["state_dict"], fresh))):
        try:  # file_save: not built yet, a clear error on every rank; the Lightning views: checked
            out[case] = call() or "no error"
        except CheckpointError as e:
            out[case] = str(e)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _ours(kind, params):
    import lightning_matrixfsdp as mf

    if kind == "muon":
        a = ADAMW_DEFAULTS
        return mf.Muon(params, adamw_betas=a["betas"], adamw_eps=a["eps"], adamw_weight_decay=a["weight_decay"],
                       **MUON_DEFAULTS)
    if kind == "shampoo":
        return mf.Shampoo(params, graft_type="sgd", pre_conditioner_type="all", **SHAMPOO)
    return mf.SOAP(params, **SOAP)


def _oracle(kind, whole):
    import pytorch_optimizer

    if kind == "muon":
        return torch.optim.Muon(whole, **MUON_DEFAULTS)
    if kind == "shampoo":
        return pytorch_optimizer.ScalableShampoo(whole, graft_type=1, pre_conditioner_type=0, **SHAMPOO)
    return pytorch_optimizer.SOAP(whole, **SOAP)


def _flat(state: dict) -> dict:
    """The oracle library's state as flat tensors (lists as ``name.i``, objects' tensors as ``name.attr``)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out.update({f"{k}.{i}": e for i, e in enumerate(v) if isinstance(e, torch.Tensor)})
        elif hasattr(v, "__dict__"):
            for a, t in vars(v).items():
                if isinstance(t, torch.Tensor):
                    out[f"{k}.{a}"] = t
                elif isinstance(t, (list, tuple)):
                    out.update({f"{k}.{a}.{i}": e for i, e in enumerate(t) if isinstance(e, torch.Tensor)})
    return {k: v for k, v in out.items() if k != "step"}


def _step_oracle(kind, mesh) -> dict:
    """3 steps; after each, every held fragment and its state against the whole-matrix oracle."""
    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    model = _sharded(mesh)
    opt = _ours(kind, list(model.parameters()))
    held = {n: p for n, p in model.named_parameters() if p.numel() and p.ndim == 2}  # this rank owns them
    whole = {n: (gather_tp(p, split_dim(n), tp) if split_dim(n) is not None else p.detach().clone()).requires_grad_()
             for n, p in held.items()}
    oracle = {n: _oracle(kind, [w]) for n, w in whole.items()}  # one optimizer per matrix: its own step count
    bad, checked, state_checked = [], 0, 0
    for step in range(3):
        loss_of(model, batch(step, dp_rank)).backward()
        for n, p in held.items():
            dim = split_dim(n)
            whole[n].grad = gather_tp(p.grad, dim, tp) if dim is not None else p.grad.clone()
            oracle[n].step()
        opt.step()
        opt.zero_grad()
        for n, p in held.items():
            dim, w = split_dim(n), whole[n].detach()
            want = slice_of(w, dim, tp) if dim is not None else w
            checked += 1
            if not torch.equal(p.detach(), want):
                bad.append((kind, step, n, "weight", (p.detach() - want).abs().max().item()))
            ours, ref = opt.state[p], oracle[n].state[whole[n]]
            if kind == "muon":  # momentum sliced on every TP rank
                m = ref["momentum_buffer"]
                if not torch.equal(ours["momentum_buffer"], slice_of(m, dim, tp) if dim is not None else m):
                    bad.append((kind, step, n, "momentum"))
                state_checked += 1
                continue
            holders = [None] * dist.get_world_size(tp)
            dist.all_gather_object(holders, bool(ours), group=tp)
            if dim is not None and sum(holders) != 1:
                bad.append((kind, step, n, f"state held on TP ranks {holders}, not on one"))
            if ours:  # the whole-matrix state, on the TP rank that stepped it
                for key, t in _flat(ref).items():
                    state_checked += 1
                    if key not in ours or not torch.equal(ours[key], t):
                        bad.append((kind, step, n, f"state {key}"))
    return {"bad": bad, "checked": checked, "state_checked": state_checked}


def _expected_tp_bytes(model, tp) -> tuple[int, int]:
    """docs/tensor-parallel.md's formula for this rank: per trainable split matrix it owns, with
    fragments n_t (elements) and stepper s (Newton-Schulz FLOPs balanced largest first, ties to
    the lower rank): a non-stepper sends 4 n_t (float32 update) and receives 2 n_t (bfloat16
    result); the stepper receives 4 (N - n_s) and sends 2 (N - n_s). TP-replicated: nothing."""
    sent, recv, _ = expected_tp(model, tp)
    return sent, recv


def expected_tp(model, tp) -> tuple[int, int, list[int]]:
    """``_expected_tp_bytes``'s (sent, recv) and the Newton-Schulz FLOPs each TP rank of this
    rank's owner steps (5 iterations of 4 m^2 k + 2 m^3, m <= k, per stepped split matrix)."""
    t_size, me = dist.get_world_size(tp), dist.get_rank(tp)
    mats = []
    for n, p in model.named_parameters():
        dim = split_dim(n)
        if dim is not None and p.numel():
            full = gather_tp(torch.zeros(p.shape), dim, tp).shape
            m, k = sorted(full)
            mats.append((-(5 * (4 * m * m * k + 2 * m ** 3)), n, [c.numel() for c in torch.zeros(full).chunk(t_size, dim)]))
    loads, sent, recv = [0] * t_size, 0, 0
    for neg, _, sizes in sorted(mats, key=lambda x: (x[0], x[1])):
        s = min(range(t_size), key=lambda r: (loads[r], r))
        loads[s] -= neg
        if me == s:
            recv, sent = recv + 4 * (sum(sizes) - sizes[s]), sent + 2 * (sum(sizes) - sizes[s])
        else:
            sent, recv = sent + 4 * sizes[me], recv + 2 * sizes[me]
    return sent, recv, loads


def _trajectory(mesh, steps: int, check_bytes: bool, micro: int = 1, checkpointing: bool = False,
                **options) -> dict:
    """The sharded run against the whole-matrix and the blockwise references, step by step
    (``micro`` batches per step; ``checkpointing``: the blocks recomputed in backward)."""
    from lightning_matrixfsdp.runtime import sync_replicas
    from lightning_matrixfsdp.runtime.tags import state_of

    tp, dp_rank = mesh["tensor_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    tp_peers = set(dist.get_process_group_ranks(tp)) - {dist.get_rank()}
    model = _sharded(mesh, checkpointing=checkpointing, **options)
    opt = _ours("muon", list(model.parameters()))
    ref, blockwise = Reference(mesh), Reference(mesh, blockwise=True)
    unsplit = Unsplit(mesh) if micro == 1 else None
    stats = state_of(model).stats
    out = {"loss_equal": True, "weights_equal": True, "blockwise_equal": True, "bytes": [], "calls": set(),
           "foreign_peers": set()}
    for step in range(steps):
        x = batch(step, dp_rank) if micro == 1 else [batch(step * micro + i, dp_rank) for i in range(micro)]
        for xb in (x if micro > 1 else [x]):
            loss = loss_of(model, xb)
            loss.backward()
        before = dict(stats.snapshot().get("tp", {"sent": 0, "recv": 0}))
        with count_collectives(count_collectives.NO_P2P_OPS) as w:  # P2POp refuses a wrapped isend/irecv
            opt.step()
        after = stats.snapshot().get("tp", {"sent": 0, "recv": 0})
        out["bytes"].append((after["sent"] - before["sent"], after["recv"] - before["recv"]))
        out["calls"] |= set(w.names)
        out["foreign_peers"] |= w.peers - tp_peers
        sync_replicas(model)  # HSDP's replica_split: the stepping replica's weights reach the other one
        opt.zero_grad()
        out["loss_equal"] &= loss.item() == ref.step(x, micro)
        blockwise.step(x, micro)
        if unsplit is not None:
            unsplit.step(x)
        for n, p in model.named_parameters():
            if p.numel():  # held here: the reference's fragment, bit for bit
                out["weights_equal"] &= torch.equal(p.detach(), ref.fragment(n))
                out["blockwise_equal"] &= torch.equal(p.detach(), blockwise.fragment(n))
    if unsplit is not None:  # how far TP's other float order takes the run from the unsplit model's
        out["unsplit_max_diff"] = max((p.detach() - unsplit.fragment(n, tp)).abs().max().item()
                                      for n, p in model.named_parameters() if p.numel())
        out["blockwise_unsplit_max_diff"] = max((blockwise.fragment(n) - unsplit.fragment(n, tp)).abs().max().item()
                                                for n, p in model.named_parameters() if p.numel())
    if check_bytes:
        out["expected_bytes"] = _expected_tp_bytes(model, tp)
    return out


def _trainer(mesh) -> dict:
    """``MatrixFSDPStrategy(tensor_parallel_size=2)``: ``configure_model`` sees Lightning's mesh and
    parallelizes; the strategy shards; the TP ranks read the same batches; 3 steps equal the reference.
    Also kept: the plan printed at setup, the logged metrics, ``get_comm_stats`` and the expected TP
    bytes and per-TP-rank Newton-Schulz loads (every owner's, gathered)."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf

    class LitTP(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net, self.seen, self.losses, self.names = Net(), [], [], None

        def configure_model(self):
            self.names = tuple(self.device_mesh.mesh_dim_names)
            parallelize(self.net, self.device_mesh["tensor_parallel"])

        def training_step(self, x, i):
            loss = loss_of(self.net, x)
            self.seen.append(x.clone())
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self):
            data = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
            return torch.utils.data.DataLoader(list(data), batch_size=4)

        def configure_optimizers(self):
            a = ADAMW_DEFAULTS
            return mf.Muon(self.parameters(), adamw_betas=a["betas"], adamw_eps=a["eps"],
                           adamw_weight_decay=a["weight_decay"], **MUON_DEFAULTS)

    import logging

    from helpers.tp_compose_scenarios import TextHandler
    from helpers.walk_scenarios import MemoryLogger

    lit, logger, printed = LitTP(), MemoryLogger(), TextHandler()
    info = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # rank_zero_info's: the plan at setup
    info.addHandler(printed)
    level = info.level
    info.setLevel(logging.INFO)
    try:
        trainer = Trainer(accelerator="cpu", devices=4, strategy=mf.MatrixFSDPStrategy(tensor_parallel_size=2),
                          max_steps=3, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(lit)
    finally:
        info.removeHandler(printed)
        info.setLevel(level)
    ref = Reference(mesh)
    sent, recv, loads = expected_tp(lit.net, mesh["tensor_parallel"].get_group())
    holders = [None] * dist.get_world_size()
    dist.all_gather_object(holders, (mesh["data_parallel"].get_local_rank(), loads))
    return {"names": lit.names, "losses": lit.losses, "ref": [ref.step(x) for x in lit.seen],
            "first_batch": lit.seen[0].sum().item(), "printed": printed.lines,
            "tp_metric": [m.get("matrix_fsdp/tp_MB") for _, m in logger.records], "expected": (sent, recv),
            "comm_stats": mf.get_comm_stats(lit), "loads": dict(holders)}


def _fabric(mesh) -> dict:
    """``MatrixFSDPFabricStrategy(tensor_parallel_size=2)``: parallelize on the strategy's mesh, then
    ``setup_module`` shards; 3 steps bitwise the reference."""
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    fabric = Fabric(accelerator="cpu", devices=4, strategy=mf.MatrixFSDPFabricStrategy(tensor_parallel_size=2))
    fabric.launch()
    names = tuple(fabric.strategy.device_mesh.mesh_dim_names)
    torch.manual_seed(0)
    net = parallelize(Net(), fabric.strategy.device_mesh["tensor_parallel"])
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(_ours("muon", list(model.parameters())))
    ref, dp_rank, same = Reference(mesh), mesh["data_parallel"].get_local_rank(), True
    for step in range(3):
        x = batch(step, dp_rank)
        loss = loss_of(model, x)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        same &= loss.item() == ref.step(x)
    same &= all(torch.equal(p.detach(), ref.fragment(n)) for n, p in net.named_parameters() if p.numel())
    return {"names": names, "same": same}


def _bf16(mesh) -> dict:
    """``param_dtype=bfloat16`` with TP: the DTensors carry bfloat16 fragments; the run stays near
    the float32 reference (a stated tolerance: 5% relative on each of 3 losses)."""
    dp_rank = mesh["data_parallel"].get_local_rank()
    model = _sharded(mesh, param_dtype=torch.bfloat16)
    opt = _ours("muon", list(model.parameters()))
    ref, losses, refs = Reference(mesh), [], []
    for step in range(3):
        x = batch(step, dp_rank)
        loss = loss_of(model, x.to(torch.bfloat16))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
        refs.append(ref.step(x))
    return {"losses": losses, "ref": refs}


def worker(rank, world):
    """Every scenario on one rank of the launch, in an order every rank follows."""
    from helpers import tp_compose_scenarios as tp_compose

    mesh = _mesh()
    res = {kind: _step_oracle(kind, mesh) for kind in ("muon", "shampoo", "soap")}
    res["trajectory"] = _trajectory(mesh, 8, check_bytes=True)  # bitwise over 8 steps proves what 20 did
    res["hsdp"] = _trajectory(mesh, 3, check_bytes=False, shard_size=1)
    res["accumulation_checkpointing"] = _trajectory(mesh, 2, check_bytes=False, micro=2, checkpointing=True)
    res["clip"] = _clip(mesh)
    res["refusals"] = _refusals(mesh)
    res["checkpoint"] = _checkpoint(mesh)
    res["checkpoint_shampoo"] = _checkpoint(mesh, "shampoo", other_mesh=False)
    res["bf16"] = _bf16(mesh)
    res["fabric"] = _fabric(mesh)
    res["trainer"] = _trainer(mesh)
    res.update(tp_compose.scenarios(mesh))
    return res
