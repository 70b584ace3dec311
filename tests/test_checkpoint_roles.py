"""A parameter whose optimizer role changed between save and load (another ``matrix_filter``).

Its saved state belongs to the other update rule (Muon's momentum vs AdamW's moments), so
a load must not place it silently: every rank raises naming the parameters, or, opted in,
restarts just their optimizer state. Checked on 2 gloo processes against the state the
owners held at save time (gathered by the test, not by the checkpoint code).
"""
from __future__ import annotations

import pickle

import torch

from helpers.models import TinyLM, batch_for, lm_loss
from test_checkpoint import assert_same_state, full_state

MUON = dict(lr=0.02, weight_decay=0.1)
SAVED_TAIL = ("tok.weight", "head.weight")          # embeddings and head on AdamW when saving
LOADED_TAIL = ("blocks.0.qkv.weight",)              # another filter when loading
CHANGED = {"tok.weight": "tail -> matrix", "head.weight": "tail -> matrix", "blocks.0.qkv.weight": "matrix -> tail"}


def _model(seed: int, tail: tuple[str, ...]):
    import lightning_matrixfsdp as mf

    torch.manual_seed(seed)
    model = mf.matrix_shard(TinyLM(), matrix_filter=lambda fqn, p: fqn not in tail)
    return model, mf.route_optimizer(mf.Muon(model.parameters(), **MUON))


def _train(model, opt, steps: int) -> None:
    import torch.distributed as dist

    for s in range(steps):
        x = batch_for(s, dist.get_rank())
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(rank, world, root):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _model(0, SAVED_TAIL)
    _train(model, opt, 2)
    C.save_sharded(model, f"{root}/d", [opt])
    C.save_sharded(model, f"{root}/f.ckpt", [opt], full=True)
    ref = full_state(model, opt)
    out = {"ref": ref, "errors": {}, "loaded": {}}
    for src in ("d", "f.ckpt"):
        other, o2 = _model(1, LOADED_TAIL)
        before = full_state(other, o2)
        try:
            C.load_sharded(other, f"{root}/{src}", [o2])
            out["errors"][src] = None
        except C.CheckpointMismatchError as e:
            out["errors"][src] = str(e)
        out.setdefault("untouched", {})[src] = _same(full_state(other, o2), before)
        C.load_sharded(other, f"{root}/{src}", [o2], reset_changed_roles=True)
        out["loaded"][src] = full_state(other, o2)
        _train(other, o2, 1)  # the reset parameters start fresh under their new rule
    return pickle.dumps(out)


def _same(a, b) -> bool:
    try:
        assert_same_state(a, b)
        return True
    except AssertionError:
        return False


def test_role_change_raises_on_every_rank_or_resets_when_asked(tmp_path, dist_pools):
    results = [pickle.loads(r) for r in dist_pools(2).run(_worker, str(tmp_path))]
    ref = results[0]["ref"]
    for rank, r in enumerate(results):
        for src in ("d", "f.ckpt"):
            msg = r["errors"][src]
            assert msg is not None, f"rank {rank}: loading {src} with changed roles did not raise"
            for name, change in CHANGED.items():
                assert f"{name}: {change}" in msg, (rank, msg)
            assert "reset_changed_roles=True" in msg
            assert r["untouched"][src], f"rank {rank}: the failed load of {src} changed the model or optimizer"
    for src in ("d", "f.ckpt"):
        got = results[0]["loaded"][src]
        assert got["params"].keys() == ref["params"].keys()
        assert all(torch.equal(got["params"][n], t) for n, t in ref["params"].items())  # weights: all of them
        assert set(got["state"]) == set(ref["state"]) - set(CHANGED), "only the changed parameters restart"
        kept = {n: s for n, s in ref["state"].items() if n not in CHANGED}
        assert_same_state({**got, "params": {}}, {**ref, "params": {}, "state": kept})


def _trainer_worker(rank, world, root):
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf
    from helpers.lit import LitTiny

    def run(tail, steps, ckpt=None, **strategy_kw):
        torch.manual_seed(0)
        lit = LitTiny("muon_bare")  # one param group, so a role change moves no parameter between groups
        strategy = mf.MatrixFSDPStrategy(matrix_filter=lambda fqn, p: fqn.split("model.", 1)[-1] not in tail,
                                         log_plan=False, **strategy_kw)
        trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root)
        trainer.fit(lit, ckpt_path=ckpt)
        return trainer

    t = run(SAVED_TAIL, 2)
    t.save_checkpoint(f"{root}/a.ckpt")
    out = {}
    try:
        run(LOADED_TAIL, 3, f"{root}/a.ckpt")
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["resumed_step"] = run(LOADED_TAIL, 3, f"{root}/a.ckpt", reset_changed_roles=True).global_step
    t = run(SAVED_TAIL, 1, verify_checkpoints=False)
    t.save_checkpoint(f"{root}/unverified.ckpt")
    return pickle.dumps(out)


def test_strategy_options_reset_changed_roles_and_verify_checkpoints(tmp_path, dist_pools):
    from lightning_matrixfsdp import checkpoint as C

    results = [pickle.loads(r) for r in dist_pools(2).run(_trainer_worker, str(tmp_path), timeout=300)]
    for rank, r in enumerate(results):
        assert r["error"] and r["error"].startswith("CheckpointMismatchError"), (rank, r["error"])
        assert "model.blocks.0.qkv.weight: matrix -> tail" in r["error"] and "reset_changed_roles=True" in r["error"]
        assert r["resumed_step"] == 3
    checked = C.read_sidecar(tmp_path / "a.ckpt")["files"]
    unchecked = C.read_sidecar(tmp_path / "unverified.ckpt")["files"]
    assert all(f["crc32"] for f in checked.values()) and not any("crc32" in f for f in unchecked.values())
