"""Split expert stacks: the planner gives each owner a contiguous block of a stack's experts.

A small mixture-of-experts model (torchtitan-style ``GroupedExperts``, declared automatically;
8 experts in one layer, 7 in the other, so blocks are uneven: (4, 3) on 2 ranks, (2, 2, 2, 1)
on 4) on 2 and 4 processes, one task each on the session's warm pools, several scenarios per task:

* the plan splits the stacks (blocks on every owner), and training equals DDP with a per-expert
  ``torch.optim.Muon`` written plainly here bit for bit (gradients, weights), the clip's total
  and ``grad_norm`` counting each expert once (float32 rounding of torch's);
* resume (2 processes): saved after 2 steps, the third step of a fresh run equals the
  uninterrupted one bit for bit, from the directory into split stacks and from the consolidated
  file into whole ones (``split_stacks=False``); a save of whole stacks resumes into split ones;
  the 4-process directory loads on 2 processes (other blocks) with the same weights and Muon
  momentum (compared through consolidated files);
* SOAP's per-expert state of split stacks resumes bitwise, split and into whole stacks;
* gradient accumulation without sync (as ``accumulate_grad_batches`` and a manual loop's
  ``toggle_model(sync_grad=False)``) equals DDP bit for bit;
* (2 processes) the directory written in the background (``async_save``'s writer) resumes bitwise,
  as the synchronous one; a Fabric loop splits the stacks and equals DDP bit for bit.

Pure (no launch): the plan's digest, its JSON round trip, the printout, and custom plans whose
blocks are not torch.chunk's refused.
"""
from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from helpers.dist import PoolTask

VOCAB, D, H = 64, 16, 24
STEPS = 3


class GroupedExperts(nn.Module):
    """torchtitan's layout (``w1``/``w3`` ``[E, H, D]``, ``w2`` ``[E, D, H]``); every token goes through
    every expert, weighted by the router (dense, so every expert gets a gradient on every rank)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, H, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, D, H) * 0.3)
        self.w3 = nn.Parameter(torch.randn(experts, H, D) * 0.3)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            h = torch.nn.functional.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)
            out = out + weights[..., e:e + 1] * (h @ self.w2[e].T)
        return out


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, experts, bias=False)
        self.experts = GroupedExperts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.experts(y, torch.softmax(self.router(y), dim=-1))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(8), Block(7)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return MoE()


def per_expert_muon(model: nn.Module):
    """DDP's optimizer, plainly: torch.optim.Muon on a separate 2-D tensor per expert of each stack,
    on the routers as they are, AdamW on the rest (embedding and head by the recipe default)."""
    from helpers.oracle import PerExpertMuon

    return PerExpertMuon(model, lambda name, p: p.shape[1] if p.ndim == 3 else None)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    from helpers.models import batch_for, lm_loss

    idx = batch_for(step, rank)
    return lm_loss(model(idx), idx)


def _train_scenario(rank: int, world: int) -> dict[str, Any]:
    """Bitwise DDP with a per-expert Muon; the norms count each expert once."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, assert_owned_grads_equal, close, compare, full_params, make_sharded_optimizer
    from helpers.oracle import allreduce_mean_grads

    sharded = build()
    oracle = copy.deepcopy(sharded)
    mf.matrix_shard(sharded)
    plan = mf.get_plan(sharded)
    opts = make_sharded_optimizer(sharded, "ours")
    ref = per_expert_muon(oracle)
    norms = []
    for step in range(STEPS):
        lo, ls = _loss(oracle, step, rank), _loss(sharded, step, rank)
        assert close(lo.detach(), ls.detach(), EXACT), f"step {step}: loss {ls.item()} vs {lo.item()}"
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle)
        assert_owned_grads_equal(sharded, oracle, EXACT, f"step {step}")
        # every expert once: the clip's total and each stack's norm against torch's on the whole gradients
        big = 1e6  # no scaling (factor 1.0 on both sides), so the weights stay bitwise comparable
        ours_norms = mf.grad_norm(sharded, 2)
        total = mf.clip_grad_norm_(sharded, big)
        want_total = torch.nn.utils.clip_grad_norm_(oracle.parameters(), big)
        norms.append((float(total), float(want_total)))
        for n, p in oracle.named_parameters():
            got = ours_norms[f"grad_2.0_norm/{n}"]
            assert torch.allclose(got, p.grad.norm(2), rtol=1e-5, atol=0), (n, got, p.grad.norm(2))
        ref.step()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        compare(full_params(sharded), dict(oracle.named_parameters()), EXACT, "param", step)
    return {"splits": {k: list(v) for k, v in plan.split_stacks.items()}, "plan": str(plan), "norms": norms,
            "digest": plan.digest()}


def _fresh(split: bool = True, kind: str = "muon"):
    import lightning_matrixfsdp as mf

    model = build()
    mf.matrix_shard(model, split_stacks=split)
    opt = mf.Muon(model, lr=0.02) if kind == "muon" else mf.SOAP(model, lr=0.01)
    return model, mf.route_optimizer(opt)


def _step(model: nn.Module, opt: Any, i: int, rank: int) -> None:
    _loss(model, i, rank).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _checkpoint_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 processes: the save that the 2-process launch loads. 2 processes: resume bitwise (split, and
    into whole stacks), the reverse, the 4-process directory on 2 processes, SOAP's state."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, compare, full_params
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    out: dict[str, Any] = {}
    model, opt = _fresh()
    for i in range(2):
        _step(model, opt, i, rank)
    mf.save_sharded(model, f"{root}/w{world}_dir", [opt])
    mf.save_sharded(model, f"{root}/w{world}_file.ckpt", [opt], full=True)
    if world == 4:
        return out
    saver = AsyncCheckpointer()  # async_save's writer: the same state, written in the background
    saver.save_sharded(model, f"{root}/w2_async", [opt])
    saver.close()
    _step(model, opt, 2, rank)
    want = full_params(model)
    for source, split in ((f"{root}/w2_dir", True), (f"{root}/w2_file.ckpt", False), (f"{root}/w2_async", True)):
        other, other_opt = _fresh(split)  # resume, and the same checkpoint where the stacks stay whole
        mf.load_sharded(other, source, [other_opt])
        assert bool(mf.get_plan(other).split_stacks) == split
        _step(other, other_opt, 2, rank)
        compare(full_params(other), want, EXACT, f"resumed from {source} (split={split})", 2)
    # the reverse: stacks whole at the save, split at the load
    whole, whole_opt = _fresh(split=False)
    for i in range(2):
        _step(whole, whole_opt, i, rank)
    mf.save_sharded(whole, f"{root}/w2_whole", [whole_opt])
    _step(whole, whole_opt, 2, rank)
    split_model, split_opt = _fresh()
    mf.load_sharded(split_model, f"{root}/w2_whole", [split_opt])
    _step(split_model, split_opt, 2, rank)
    compare(full_params(split_model), full_params(whole), EXACT, "whole -> split", 2)
    # the 4-process directory (blocks of 2 experts) into blocks of 4: the same weights and momentum
    other, other_opt = _fresh()
    mf.load_sharded(other, f"{root}/w4_dir", [other_opt])
    mf.save_sharded(other, f"{root}/w4_as_w2.ckpt", [other_opt], full=True)
    if rank == 0:
        out["cross"] = _same_checkpoint(torch.load(f"{root}/w4_file.ckpt", weights_only=False),
                                        torch.load(f"{root}/w4_as_w2.ckpt", weights_only=False))
    # SOAP's per-expert state of split stacks: each owner's block is a chunk of the whole [E, ...] state
    soap, soap_opt = _fresh(kind="soap")
    for i in range(2):
        _step(soap, soap_opt, i, rank)
    mf.save_sharded(soap, f"{root}/w2_soap", [soap_opt])
    _step(soap, soap_opt, 2, rank)
    for split in (True, False):
        other, other_opt = _fresh(split, kind="soap")
        mf.load_sharded(other, f"{root}/w2_soap", [other_opt])
        _step(other, other_opt, 2, rank)
        compare(full_params(other), full_params(soap), EXACT, f"SOAP resumed (split={split})", 2)
    out["soap"] = "resumed"
    out["async"] = "resumed"  # reached only if the background-written directory resumed bitwise above
    return out


def _fabric_scenario(rank: int, world: int) -> str:
    """``MatrixFSDPFabricStrategy``: ``setup_module`` splits the stacks as ``matrix_shard`` does and a
    Fabric loop equals DDP with the per-expert Muon bit for bit. Returns the first mismatch ("" if none)."""
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, compare, full_params, make_sharded_optimizer
    from helpers.oracle import allreduce_mean_grads

    fabric = Fabric(accelerator="cpu", devices=world, strategy=mf.MatrixFSDPFabricStrategy(log_plan=False))
    fabric.launch()
    model = build()
    oracle = copy.deepcopy(model)
    model = fabric.setup_module(model)
    (opt,) = make_sharded_optimizer(model, "ours")
    opt, ref = fabric.setup_optimizers(opt), per_expert_muon(oracle)
    try:
        assert mf.get_plan(model).split_stacks, "Fabric did not split the stacks"
        for step in range(2):
            fabric.backward(_loss(model, step, rank))
            _loss(oracle, step, rank).backward()
            allreduce_mean_grads(oracle)
            opt.step()
            opt.zero_grad()
            ref.step()
            compare(full_params(model.module), dict(oracle.named_parameters()), EXACT, "param", step)
    except AssertionError as e:
        return str(e)[:2000]
    return ""


def _same_checkpoint(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ between two consolidated checkpoints (weights and optimizer state)."""
    bad = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    names_a = [n for g in sa["param_groups"] for n in g["param_names"]]
    assert names_a == [n for g in sb["param_groups"] for n in g["param_names"]]
    for i, name in enumerate(names_a):
        for k, v in sa["state"].get(i, {}).items():
            if isinstance(v, torch.Tensor) and not torch.equal(v, sb["state"][i][k]):
                bad.append(f"{name}.{k}")
    return bad


def _accumulation_scenario(rank: int, world: int) -> str:
    """Two micro-batches per step, the first without gradient sync (what Lightning's
    ``accumulate_grad_batches`` and a manual loop's ``toggle_model(sync_grad=False)`` set): the split
    blocks get the whole window's gradient, bitwise DDP's mean of the summed micro-batches. Returns
    the first mismatch ("" if none), so only this scenario's test fails on one."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, compare, full_params, make_sharded_optimizer
    from helpers.oracle import allreduce_mean_grads

    sharded = build()
    oracle = copy.deepcopy(sharded)
    mf.matrix_shard(sharded)
    opts, ref = make_sharded_optimizer(sharded, "ours"), per_expert_muon(oracle)
    try:
        for step in range(2):
            for micro in range(2):
                mf.set_requires_gradient_sync(sharded, micro == 1)
                (_loss(oracle, 2 * step + micro, rank) / 2).backward()
                (_loss(sharded, 2 * step + micro, rank) / 2).backward()
            allreduce_mean_grads(oracle)
            ref.step()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            compare(full_params(sharded), dict(oracle.named_parameters()), EXACT, "param", step)
    except AssertionError as e:
        return str(e)[:2000]
    return ""


def worker(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"train": _train_scenario(rank, world), "checkpoint": _checkpoint_scenario(rank, world, root),
            "accumulate": _accumulation_scenario(rank, world),
            "fabric": _fabric_scenario(rank, world) if world == 2 else ""}


ROOT = tempfile.mkdtemp(prefix="stack_split_")
TASKS = {w: PoolTask(worker, ROOT, timeout=600) for w in (4, 2)}  # on the session's warm pools


def _results(world: int, dist_pools) -> list[dict[str, Any]]:
    if world == 2:
        TASKS[4].results(dist_pools(4))  # the 2-process task loads the 4-process checkpoint
    return TASKS[world].results(dist_pools(world))


@pytest.mark.parametrize("world", [2, 4])
def test_split_stacks_equal_ddp_with_per_expert_muon(world: int, dist_pools) -> None:
    res = _results(world, dist_pools)
    train = res[0]["train"]
    splits = train["splits"]
    assert splits, train["plan"]
    for fqn, blocks in splits.items():  # contiguous blocks on every owner, torch.chunk's sizes
        assert [o for _, _, o in blocks] == list(range(world)), (fqn, blocks)
        assert blocks[0][0] == 0 and all(blocks[i][1] == blocks[i + 1][0] for i in range(world - 1)), blocks
    sizes = {tuple(b - a for a, b, _ in blocks) for blocks in splits.values()}
    assert {2: (4, 3), 4: (2, 2, 2, 1)}[world] in sizes, sizes  # the 7-expert layer: uneven blocks
    assert "rank 1 experts [" in train["plan"], train["plan"]
    assert len({r["train"]["digest"] for r in res}) == 1
    for total, want in train["norms"]:
        assert total == pytest.approx(want, rel=1e-6), train["norms"]


@pytest.mark.parametrize("world", [2, 4])
def test_split_stacks_accumulate_without_sync_as_ddp(world: int, dist_pools) -> None:
    assert [r["accumulate"] for r in _results(world, dist_pools)] == [""] * world


def test_split_stacks_resume_and_load_across_plans(dist_pools) -> None:
    res = _results(2, dist_pools)
    cross = res[0]["checkpoint"]["cross"]
    assert cross == [], cross  # weights and Muon momentum of the 4-process save, bit for bit


def test_split_stacks_soap_state_resumes_split_and_whole(dist_pools) -> None:
    for r in _results(2, dist_pools):
        assert r["checkpoint"]["soap"] == "resumed", r["checkpoint"]


def test_split_stacks_resume_from_an_async_save(dist_pools) -> None:
    """The directory ``AsyncCheckpointer`` (``async_save=True``) writes in the background resumes split
    stacks bit for bit, as the synchronous save's does."""
    for r in _results(2, dist_pools):
        assert r["checkpoint"]["async"] == "resumed", r["checkpoint"]


def test_split_stacks_through_fabric_equal_ddp_with_per_expert_muon(dist_pools) -> None:
    assert [r["fabric"] for r in _results(2, dist_pools)] == ["", ""]


# ---------------------------------------------------------------------- pure: the plan
def _specs(experts: tuple[int, ...] = (8, 7)):
    from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
    from lightning_matrixfsdp.runtime.placement import ParamSpec, UnitSpec

    units = []
    for i, e in enumerate(experts):
        f = f"layers.{i}"
        units.append(UnitSpec(f, (
            ParamSpec(f"{f}.norm.weight", (D,), "float32", False),
            ParamSpec(f"{f}.router.weight", (e, D), "float32", True),
            ParamSpec(f"{f}.experts.w1", (e, H, D), "float32", True, True, ExpertStack(e, (H,))),
            ParamSpec(f"{f}.experts.w2", (e, D, H), "float32", True, True, ExpertStack(e, (D,))),
            ParamSpec(f"{f}.experts.w3", (e, H, D), "float32", True, True, ExpertStack(e, (H,))))))
    units.append(UnitSpec("", (ParamSpec("embed.weight", (VOCAB, D), "float32", False),)))
    return units


@pytest.mark.parametrize("planner", ["role_greedy", "scope_greedy", "cost_aware"])
def test_split_plan_is_deterministic_and_serialized(planner: str) -> None:
    from lightning_matrixfsdp.runtime.placement import Plan
    from lightning_matrixfsdp.runtime.planner import make_plan

    a, b = make_plan(_specs(), 4, planner, split_stacks=True), make_plan(_specs(), 4, planner, split_stacks=True)
    assert a.split_stacks and a.digest() == b.digest() and a.to_dict() == b.to_dict()
    back = Plan.from_json(a.to_json())
    assert back.digest() == a.digest() and back.split_stacks == a.split_stacks
    assert len(a.pieces("layers.1.experts.w1")) == 4 and a.shard("layers.1.experts.w1").experts == (0, 2)
    whole = make_plan(_specs(), 4, planner, split_stacks=False)
    assert not whole.split_stacks and whole.digest() != a.digest()
    # an entry without a block serializes as before (no "experts" key): earlier plans and digests stay valid
    assert all("experts" not in s.to_dict() for s in whole.shards())
    # memory and optimizer compute balance better with the split
    assert max(a.memory_imbalance, a.compute_imbalance) < max(whole.memory_imbalance, whole.compute_imbalance)


def test_split_needs_every_rank_to_get_an_expert() -> None:
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.experts.split import chunk_sizes
    from lightning_matrixfsdp.runtime.tp.layout import chunk_sizes as dtensor_chunks

    assert all(chunk_sizes(n, w) == dtensor_chunks(n, w) for n in range(12) for w in range(1, 6))
    plan = make_plan(_specs((6, 5)), 4, split_stacks=True)  # 6 over 4: (2, 2, 2, 0); 5: (2, 2, 1, 0)
    assert not plan.split_stacks


def test_custom_planner_blocks_must_be_torch_chunks() -> None:
    from dataclasses import replace

    from lightning_matrixfsdp.runtime.placement import UnitLayout
    from lightning_matrixfsdp.runtime.planner import make_plan

    good = make_plan(_specs(), 4, split_stacks=True)

    def off_by_one(units, world):
        plan = make_plan(_specs(), 4, split_stacks=True)
        layouts = []
        for u in plan.units:
            shards = tuple(replace(s, experts=(s.experts[0], s.experts[1] + 1)) if s.experts and s.owner == 0
                           else replace(s, experts=(s.experts[0] + 1, s.experts[1])) if s.experts and s.owner == 1
                           else s for s in u.shards)
            layouts.append(UnitLayout(u.fqn, u.world, shards))
        plan.units = layouts
        return plan

    assert make_plan(_specs(), 4, lambda units, world: make_plan(units, world, split_stacks=True),
                     split_stacks=True).digest() == good.digest()
    with pytest.raises(ValueError, match="torch.chunk"):
        make_plan(_specs(), 4, off_by_one, split_stacks=True)
    with pytest.raises(ValueError, match="cannot serve"):
        make_plan(_specs(), 4, lambda units, world: make_plan(units, world, split_stacks=True), split_stacks=False)


def test_split_stacks_off_where_not_served() -> None:
    """Tensor parallelism, HSDP replicas and expert parallelism keep stacks whole (the printout says
    why); ``split_stacks=False`` too; a model without stacks has nothing to say."""
    from lightning_matrixfsdp.runtime.classify import RoleChoice
    from lightning_matrixfsdp.runtime.comm.core import ShardGroup
    from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
    from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
    from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
    from lightning_matrixfsdp.runtime.shard import splits_served

    roles = {"w": RoleChoice(True, ExpertStack(8, (H,)), "declared")}
    plain = MeshInfo(ShardGroup(None))
    assert splits_served(MatrixFSDPConfig(), plain, roles) == (True, "")
    assert splits_served(MatrixFSDPConfig(split_stacks=False), plain, roles) == (False, "")
    assert splits_served(MatrixFSDPConfig(), plain, {"w": RoleChoice(True, None, "2-D")}) == (False, "")
    for mesh, config, word in ((MeshInfo(ShardGroup(None), replicate_size=2), MatrixFSDPConfig(), "HSDP"),
                               (MeshInfo(ShardGroup(None), tp_size=2), MatrixFSDPConfig(), "tensor parallelism"),
                               (plain, MatrixFSDPConfig(expert_parallel_size=2), "expert parallelism")):
        split, why = splits_served(config, mesh, roles)
        assert not split and word in why, why
