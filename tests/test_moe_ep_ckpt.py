"""Checkpoints and meta-device initialization with expert parallelism (CPU gloo, float64).

A tiny token model of two MoE blocks in torchtitan's shape (``parallelize_experts``, the stacks
declared with ``expert_stacks``), 4 experts. One task on the session's 4 gloo workers saves at EP=2
(Muon, Shampoo, SOAP), keeps training to give the uninterrupted run, resumes at EP=2 (bitwise) and
loads at EP=1; then one task on the 2 workers loads the same checkpoints at EP=2 and EP=1 (another
world size) and keeps training. The oracles are plain: the uninterrupted run itself, the weights
and the optimizer state gathered whole at the save, and a one-process meta-device initialization
(``to_empty`` and each module's ``reset_parameters`` in module order) written here.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.timeout(900)

DTYPE = torch.float64
EXPERTS, DIM, HIDDEN, VOCAB = 4, 8, 16, 32
SAVE_AT, STEPS = 2, 4   # save after 2 steps, the uninterrupted run goes on to 4
MICRO = 4               # micro-batches per step: world W takes MICRO / W of them, concatenated
#: another world size or expert-parallel size sums the gradients in another order (float64)
TOL = 1e-9
STACKS = ["*.experts.w1", "*.experts.w2"]  # declared expert stacks: matrices per expert


class Experts(nn.Module):
    """Stacked experts ``w1 [E, H, D]``, ``w2 [E, D, H]``; rows sorted by expert with their counts."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, DIM, HIDDEN))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=DIM ** -0.5)
        nn.init.uniform_(self.w2, -HIDDEN ** -0.5, HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert.tolist()):
            xe = x[start:start + n]
            start += n
            outs.append(F.silu(xe @ self.w1[e].T) @ self.w2[e].T)
        return torch.cat(outs)


class Block(nn.Module):
    def __init__(self) -> None:
        import lightning_matrixfsdp as mf

        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = mf.parallelize_experts(Experts())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, DIM)
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), 2, dim=-1)
        order = torch.argsort(index.reshape(-1), stable=True)
        counts = torch.bincount(index.reshape(-1), minlength=EXPERTS)
        y_sorted = self.experts(flat.repeat_interleave(2, dim=0)[order], counts)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return x + (y.view(-1, 2, DIM) * weights[..., None]).sum(1).view_as(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DTYPE)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of the step's ``MICRO`` micro-batches (equal token counts: the mean of
    the concatenation is the mean of the micro-batches' means, at any world size)."""
    per = MICRO // world
    parts = [torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1000 * step + j))
             for j in range(rank * per, (rank + 1) * per)]
    return torch.cat(parts)


def optimizer(name: str, model: nn.Module):
    import lightning_matrixfsdp as mf

    params = mf.param_groups(model, expert_stacks=STACKS)  # the Muon recipe: each expert a matrix
    if name == "muon":
        opt = mf.Muon(params, lr=0.02, weight_decay=0.1, adamw_lr=0.01)
    elif name == "shampoo":  # preconditioning from the first step, recomputed every other step
        opt = mf.Shampoo(params, lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=2)
    else:
        opt = mf.SOAP(params, lr=0.01, precondition_frequency=2)
    return mf.route_optimizer(opt)


def sharded(name: str, ep: int):
    import lightning_matrixfsdp as mf

    model = build()
    mf.matrix_shard(model, expert_parallel_size=ep, expert_stacks=STACKS)
    return model, optimizer(name, model)


def train(model, opt, steps, rank: int, world: int) -> None:
    for step in steps:
        opt.zero_grad()
        model(batch(step, rank, world)).backward()
        opt.step()


def _first_group(t: torch.Tensor, ep: int) -> torch.Tensor:
    """Every rank's ``t`` gathered, the first expert-parallel group's concatenated (the whole stack)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts[:ep])


def whole(model) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank: dense ones from their owners, expert stacks joined."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of, shard_of, state_of

    sg = state_of(model).sg
    out = {}
    for name, p in model.named_parameters():
        s = expert_slice_of(p)
        if s is not None:
            out[name] = _first_group(p.detach(), s.groups.ep_size)
            continue
        shard = shard_of(p)
        t = torch.empty(shard.shape, dtype=p.dtype)
        # each piece from its owner: the whole parameter, or each block of a stack the plan split
        for piece in state_of(model).plan.pieces(shard.fqn):
            rows = t if piece.experts is None else t[piece.experts[0]:piece.experts[1]]
            if piece.owner == sg.rank:
                rows.copy_(p.detach())
            dist.broadcast(rows, src=sg.g(piece.owner), group=sg.group)
        out[name] = t
    return out


def stack_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """The expert stacks' optimizer state tensors whole (each rank's experts joined along dim 0)."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    out = {}
    for name, p in model.named_parameters():
        s = expert_slice_of(p)
        if s is not None:
            out[name] = {k: (_first_group(v, s.groups.ep_size) if v.ndim else v.clone())
                         for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    return out


def apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- checkpoints
def save_and_reference(rank: int, world: int, root: str, name: str) -> dict:
    """World 4, EP=2: save after ``SAVE_AT`` steps (and a consolidated file for Shampoo), the
    uninterrupted run on to ``STEPS``; resume at EP=2 (directory, file) and load at EP=1."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import save_sharded
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    out: dict = {}
    model, opt = sharded(name, 2)
    train(model, opt, range(SAVE_AT), rank, world)
    save_sharded(model, os.path.join(root, name), [opt])
    saver = AsyncCheckpointer() if name == "shampoo" else None
    if saver is not None:  # a consolidated file, and an asynchronous save written while training goes on
        save_sharded(model, os.path.join(root, "shampoo.ckpt"), [opt], full=True)
        saver.save_sharded(model, os.path.join(root, "shampoo_async"), [opt])
    at_save, state_at_save = whole(model), stack_state(model, opt)
    if name != "muon":  # per-expert statistics [E, m, m] / [E, n, n], not shaped like the stack
        assert any(v.shape[1:] != at_save[n].shape[1:] for n, st in state_at_save.items() for v in st.values()
                   if v.ndim == 3), f"{name}: no per-expert statistics in the stacks' state"
    train(model, opt, range(SAVE_AT, STEPS), rank, world)
    if saver is not None:
        saver.wait()
        saver.close()
    reference = whole(model)
    if rank == 0:
        torch.save({"at_save": at_save, "state": state_at_save, "reference": reference},
                   os.path.join(root, f"{name}_ref.pt"))

    resumed, ropt = sharded(name, 2)
    train(resumed, ropt, range(7, 8), rank, world)  # other state first: the load must replace all of it
    mf.load_sharded(resumed, os.path.join(root, name), [ropt])
    out["state_loaded_equal"] = all(equal(stack_state(resumed, ropt)[k], v) for k, v in state_at_save.items())
    train(resumed, ropt, range(SAVE_AT, STEPS), rank, world)
    out["resume_ep2_bitwise"] = equal(whole(resumed), reference)

    plain, popt = sharded(name, 1)
    mf.load_sharded(plain, os.path.join(root, name), [popt])
    out["load_ep1_weights_equal"] = equal(whole(plain), at_save)
    train(plain, popt, range(SAVE_AT, STEPS), rank, world)
    out["ep1_continues"] = apart(whole(plain), reference)

    if name == "shampoo":  # the consolidated file: resumed from at EP=2, and read as one process would
        again, aopt = sharded(name, 2)
        mf.load_sharded(again, os.path.join(root, "shampoo.ckpt"), [aopt])
        train(again, aopt, range(SAVE_AT, STEPS), rank, world)
        out["resume_file_bitwise"] = equal(whole(again), reference)
        mf.load_sharded(again, os.path.join(root, "shampoo_async"), [aopt])
        out["async_equal"] = equal(whole(again), at_save) and all(
            equal(stack_state(again, aopt)[k], v) for k, v in state_at_save.items())
        if rank == 0:
            out.update(consolidated(os.path.join(root, "shampoo.ckpt"), at_save, state_at_save))
    return out


def consolidated(path: str, at_save: dict, state_at_save: dict) -> dict:
    """The file against the weights and the stacks' state gathered at the save, and loaded into
    the plain one-process model (its own keys and shapes, no expert parallelism anywhere)."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    sd = ck["state_dict"]
    one = build()
    one.load_state_dict(sd)
    opt_state = ck["optimizer_states"][0]  # torch's format: ids, each group with its param_names
    by_name = {n: opt_state["state"][i] for g in opt_state["param_groups"]
               for n, i in zip(g["param_names"], g["params"]) if i in opt_state["state"]}
    return {"file_weights_equal": equal({k: v for k, v in one.state_dict().items()}, at_save),
            "file_state_equal": all(equal({k: v for k, v in by_name[n].items() if isinstance(v, torch.Tensor)},
                                          st) for n, st in state_at_save.items())}


def load_elsewhere(rank: int, world: int, root: str, name: str) -> dict:
    """World 2: the world-4 checkpoint loaded at EP=2 and at EP=1, trained on (the same global
    batches) beside the uninterrupted world-4 run."""
    import lightning_matrixfsdp as mf

    ref = torch.load(os.path.join(root, f"{name}_ref.pt"), weights_only=False)
    out = {}
    for ep in (2, 1):
        model, opt = sharded(name, ep)
        mf.load_sharded(model, os.path.join(root, name), [opt])
        out[f"ep{ep}_weights_equal"] = equal(whole(model), ref["at_save"])
        if ep == 2:
            out["ep2_state_equal"] = all(equal(stack_state(model, opt)[k], v) for k, v in ref["state"].items())
        train(model, opt, range(SAVE_AT, STEPS), rank, world)
        out[f"ep{ep}_continues"] = apart(whole(model), ref["reference"])
    return out


# ---------------------------------------------------------------------- meta-device initialization
def one_process_init(seed: int, dtype: torch.dtype = DTYPE) -> tuple[Net, torch.Tensor]:
    """The unsplit model on the meta device, materialized, each module's reset_parameters in
    module order; and where the generator is afterwards."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        net = Net().to(dtype)
    net.to_empty(device="cpu")
    with torch.no_grad():
        for m in net.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    return net, torch.rand(3)


def held_wrong(model: nn.Module, ref: nn.Module, dense: bool = True) -> list[str]:
    """The parameters this rank holds that differ from ``ref``'s (an expert stack: its slice)."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    want = dict(ref.named_parameters())
    wrong = []
    for name, p in model.named_parameters():
        s = expert_slice_of(p)
        if s is not None:
            expect = want[name].detach()[s.first:s.first + s.count]
        elif dense and p.numel():
            expect = want[name].detach()
        else:
            continue
        if p.shape != expect.shape or not torch.equal(p.detach(), expect):
            wrong.append(name)
    return wrong


def meta_init(rank: int, world: int, ep: int) -> dict:
    """A meta-device model sharded with EP against the one-process initialization: every rank
    seeded alike (every held parameter and the generator equal), then rank 0 seeded otherwise
    than the others (the experts still rank 0's: they come from there)."""
    import lightning_matrixfsdp as mf

    ref, after_ref = one_process_init(7)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = Net().to(DTYPE)
    mf.matrix_shard(model, expert_parallel_size=ep, expert_stacks=STACKS)
    out = {"wrong": held_wrong(model, ref), "generator": torch.equal(torch.rand(3), after_ref)}
    x = batch(0, rank, world)
    with torch.no_grad():  # the model runs: its loss is the one-process model's on this rank's batch
        out["loss_apart"] = abs(model(x).item() - ref(x).item())
    torch.manual_seed(7 if rank == 0 else 100 + rank)
    with torch.device("meta"):
        model = Net().to(DTYPE)
    mf.matrix_shard(model, expert_parallel_size=ep, expert_stacks=STACKS)
    out["experts_wrong_seeds_differ"] = held_wrong(model, ref, dense=False)
    return out


def meta_then_pretrained(rank: int, world: int, root: str) -> list[str]:
    """A meta-device model whose experts modules have no ``reset_parameters`` (as Hugging Face's):
    its experts stay uninitialized when sharded with EP=2, and ``load_pretrained`` of the
    one-process model's safetensors fills each rank's experts (and the owners' dense weights)."""
    import lightning_matrixfsdp as mf
    from safetensors.torch import save_file

    path = os.path.join(root, "pretrained.safetensors")
    ref = build(3)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    dist.barrier()
    with torch.device("meta"):
        model = Net().to(DTYPE)
    for block in model.blocks:
        block.experts.reset_parameters = None  # nothing initializes the experts: they wait for the weights
    mf.matrix_shard(model, expert_parallel_size=2, expert_stacks=STACKS)
    mf.load_pretrained(model, path)
    return held_wrong(model, ref)


def parent_writes_experts(rank: int, world: int) -> tuple[str, float]:
    """A block whose own ``reset_parameters`` also draws the experts' ``w1``: under EP it would draw
    for this rank's experts only (another random stream than one process), so it is refused, on
    every rank, within seconds. The message and the seconds."""
    import time
    import types

    import lightning_matrixfsdp as mf

    def reset(block: nn.Module) -> None:
        nn.init.ones_(block.scale)
        nn.init.normal_(block.experts.w1)

    with torch.device("meta"):
        model = Net().to(DTYPE)
        for block in model.blocks:
            block.scale = nn.Parameter(torch.ones(DIM, dtype=DTYPE))
            block.reset_parameters = types.MethodType(reset, block)
    start = time.monotonic()
    try:
        mf.matrix_shard(model, expert_parallel_size=2, expert_stacks=STACKS)
        return "no error", 0.0
    except mf.MatrixShardError as e:
        return str(e), time.monotonic() - start
    finally:
        dist.barrier()


def trainer_meta_init(rank: int, world: int) -> list[str]:
    """The same through the Trainer: ``init_module(empty_init=True)``, sharded by the strategy
    with EP=2 in a fit of no step (float32, Lightning's default precision)."""
    import lightning_matrixfsdp as mf
    from lightning.pytorch import LightningModule, Trainer

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def configure_model(self) -> None:
            torch.manual_seed(7)  # the seed right before the strategy shards (so initializes)

        def training_step(self, x, i):  # never runs (max_steps=0)
            return self.net(x)

        def configure_optimizers(self):
            return optimizer("muon", self)

    strategy = mf.MatrixFSDPStrategy(expert_parallel_size=2, expert_stacks=STACKS)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    with trainer.init_module(empty_init=True):
        lit = Lit()
    assert all(p.is_meta for p in lit.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader([batch(0, 0, 1)[0]] * 4, batch_size=2))
    ref, _ = one_process_init(7, torch.float32)
    return held_wrong(lit.net, ref)


def fabric_meta_init(rank: int, world: int) -> list[str]:
    """The same through Fabric: ``init_module(empty_init=True)``, then ``fabric.setup`` shards it
    with EP=2 (float32)."""
    import lightning_matrixfsdp as mf
    from lightning.fabric import Fabric

    strategy = mf.MatrixFSDPFabricStrategy(log_plan=False, expert_parallel_size=2, expert_stacks=STACKS)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        net = Net()
    assert all(p.is_meta for p in net.parameters())
    torch.manual_seed(7)  # the seed right before the strategy shards (so initializes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = fabric.setup(net)
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    inner = getattr(net, "module", net)
    assert any(expert_slice_of(p) is not None for p in inner.parameters()), "Fabric did not shard the experts"
    ref, _ = one_process_init(7, torch.float32)
    return held_wrong(inner, ref)


# ---------------------------------------------------------------------- launches
def _world4(rank: int, world: int, root: str) -> dict:
    out = {name: save_and_reference(rank, world, root, name) for name in ("shampoo", "soap", "muon")}
    out["meta_ep2"] = meta_init(rank, world, 2)
    out["meta_ep4"] = meta_init(rank, world, 4)
    return out


def _world2(rank: int, world: int, root: str) -> dict:
    out = {name: load_elsewhere(rank, world, root, name) for name in ("shampoo", "muon")}
    out["meta_ep2"] = meta_init(rank, world, 2)
    out["trainer_meta"] = trainer_meta_init(rank, world)
    out["fabric_meta"] = fabric_meta_init(rank, world)
    out["meta_pretrained"] = meta_then_pretrained(rank, world, root)
    out["parent_writes"] = parent_writes_experts(rank, world)
    return out


@pytest.fixture(scope="module")
def launches(dist_pools):
    """World 4 saves, then world 2 loads its checkpoints (one task each, in the session's gloo pools)."""
    root = tempfile.mkdtemp(prefix="moe_ep_ckpt_")
    try:
        w4 = dist_pools(4).run(_world4, root, timeout=600)
        w2 = dist_pools(2).run(_world2, root, timeout=600)
        yield SimpleNamespace(w4=w4, w2=w2, root=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", ["shampoo", "soap", "muon"])
def test_resume_at_ep2_is_bitwise_and_loads_at_ep1(launches, name):
    for r in launches.w4:
        c = r[name]
        assert c["state_loaded_equal"], c   # every rank's experts' state, at its offset in the stack
        assert c["resume_ep2_bitwise"], c
        assert c["load_ep1_weights_equal"], c
        assert c["ep1_continues"] < TOL, c


def test_consolidated_file_and_async_save_of_an_ep_checkpoint(launches):
    for rank, r in enumerate(launches.w4):
        c = r["shampoo"]
        assert c["resume_file_bitwise"] and c["async_equal"], c
        if rank == 0:
            assert c["file_weights_equal"] and c["file_state_equal"], c


@pytest.mark.parametrize("name", ["shampoo", "muon"])
def test_world4_checkpoint_loads_at_world2(launches, name):
    for r in launches.w2:
        c = r[name]
        assert c["ep2_weights_equal"] and c["ep1_weights_equal"] and c["ep2_state_equal"], c
        assert c["ep2_continues"] < TOL and c["ep1_continues"] < TOL, c


@pytest.mark.parametrize("world,ep", [(4, 2), (4, 4), (2, 2)])
def test_meta_init_with_expert_parallelism_equals_one_process_init(launches, world, ep):
    for r in (launches.w4 if world == 4 else launches.w2):
        m = r[f"meta_ep{ep}"]
        assert m["wrong"] == [] and m["experts_wrong_seeds_differ"] == [], m
        assert m["generator"], "the generator did not advance as in the one-process initialization"
        assert m["loss_apart"] < 1e-12, m


def test_meta_init_with_expert_parallelism_through_the_trainer(launches):
    for r in launches.w2:
        assert r["trainer_meta"] == [], r["trainer_meta"]


def test_meta_init_with_expert_parallelism_through_fabric(launches):
    for r in launches.w2:
        assert r["fabric_meta"] == [], r["fabric_meta"]


def test_meta_init_with_expert_parallelism_then_load_pretrained(launches):
    for r in launches.w2:
        assert r["meta_pretrained"] == [], r["meta_pretrained"]


def test_meta_init_refuses_a_parent_that_writes_the_experts_on_every_rank(launches):
    for r in launches.w2:
        message, seconds = r["parent_writes"]
        assert "writes the expert stack" in message and "blocks.0.experts.w1" in message, message
        assert seconds < 10, seconds


def test_world4_checkpoint_loads_in_one_process_without_a_process_group(launches, name="shampoo"):
    """This process alone loads the EP=2 directory: into the plain model (the stacks tagged as
    outside ``matrix_shard``), every weight and the whole stacks' state equal to every rank's
    gathered at the save; into the model sharded over this one process, and two more steps on all
    the micro-batches follow the uninterrupted 4-process run."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.classify import tag_expert_stacks

    ref = torch.load(os.path.join(launches.root, f"{name}_ref.pt"), weights_only=False)
    plain = build()
    tag_expert_stacks(plain, expert_stacks=STACKS)
    opt = optimizer(name, plain)
    mf.load_sharded(plain, os.path.join(launches.root, name), [opt])
    params = dict(plain.named_parameters())
    assert equal({n: p.detach() for n, p in params.items()}, ref["at_save"])
    for n, state in ref["state"].items():
        assert equal({k: v for k, v in opt.state[params[n]].items() if isinstance(v, torch.Tensor)}, state), n

    model, opt = sharded(name, 1)
    mf.load_sharded(model, os.path.join(launches.root, name), [opt])
    train(model, opt, range(SAVE_AT, STEPS), 0, 1)
    assert apart({n: p.detach() for n, p in model.named_parameters()}, ref["reference"]) < TOL
