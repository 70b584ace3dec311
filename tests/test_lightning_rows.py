"""Everyday Lightning patterns under ``strategy="matrix_fsdp"``, each run side by side with
Lightning's own ``strategy="ddp"`` in the same process group and compared with it:
reentrant activation checkpointing in user code, a forward on rank 0 only (refused within
seconds; ``full_model`` runs it), a second ``fit`` after an exception in ``forward``, and
``torch.save`` of the trained model.  The workers compare in place (tensors do not travel
back) and return what differs."""
from __future__ import annotations

import copy
import io
import os
import time
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from helpers.dist import run_distributed
from helpers.lit import LitTiny, gather_full
from helpers.models import lm_loss

WORLD = 2
LONE_WAIT_S = 2  # MATRIX_FSDP_LONE_FORWARD_TIMEOUT in the workers; the process group's is 30 min


def _trainer(strategy: str, **kw: Any):
    from lightning.pytorch import Trainer

    args = dict(accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    args.update(kw)
    return Trainer(strategy=strategy, **args)


def _weights(lit: LitTiny) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered from the owners under matrix_fsdp)."""
    return gather_full(lit.model)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (all of them if the keys differ)."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------- 1. reentrant checkpointing
class ReentrantLit(LitTiny):
    """Block 0 is checkpointed around its call (the unit's forward runs without grad, then again
    inside backward), block 1 inside its own forward, both with use_reentrant=True."""

    def __init__(self) -> None:
        super().__init__()
        inner = self.model.blocks[1]
        forward = inner.forward
        inner.forward = lambda x: checkpoint(forward, x, use_reentrant=True)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        m = self.model
        x = m.tok(batch) + m.pos[: batch.shape[1]]
        x = checkpoint(m.blocks[0], x, use_reentrant=True)
        x = m.blocks[1](x)
        loss = lm_loss(m.head(m.ln_f(x)), batch)
        self.losses.append(loss.item())
        return loss


def _reentrant_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp  # noqa: F401  (registers "matrix_fsdp")

    out = {}
    for strategy in ("ddp", "matrix_fsdp"):
        torch.manual_seed(0)
        lit = ReentrantLit()
        _trainer(strategy, max_steps=4).fit(lit)
        out[strategy] = (lit.losses, _weights(lit))
    return {"losses": (out["ddp"][0], out["matrix_fsdp"][0]), "differ": _differ(out["ddp"][1], out["matrix_fsdp"][1])}


def test_reentrant_checkpointing_in_user_code_equals_ddp(dist_pools):
    for r in dist_pools(WORLD).run(_reentrant_worker):
        ddp_losses, losses = r["losses"]
        assert len(losses) == 4 and losses == ddp_losses
        assert not r["differ"], r["differ"]


# ---------------------------------------------------------------------- 2. a forward on rank 0 only
PROMPT = torch.arange(5).view(1, 5)


class SamplingLit(LitTiny):
    """Samples a few tokens greedily on rank 0 at the end of each validation epoch:
    ``lone`` as users write it under DDP, ``full`` through ``full_model``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lone_error: Any = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _sample(self) -> None:
        idx, logits = PROMPT.clone(), []
        for _ in range(4):
            out = self(idx)[:, -1]
            logits.append(out)
            idx = torch.cat([idx, out.argmax(-1, keepdim=True)], dim=1)
        self.samples.append((idx, torch.stack(logits)))

    def on_validation_epoch_end(self) -> None:
        import lightning_matrixfsdp as mf

        if self.how == "full":
            with mf.full_model(self, rank=0):
                if self.trainer.is_global_zero:
                    self._sample()
        elif self.trainer.is_global_zero:
            start = time.monotonic()
            try:
                self._sample()
            except mf.LoneForwardError as e:
                self.lone_error = (str(e), time.monotonic() - start)
                raise


def _sampling_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf

    os.environ[mf.runtime.consensus.LONE_FORWARD_ENV] = str(LONE_WAIT_S)
    out: dict = {}
    kw = dict(max_epochs=2, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
    # The lone forward last: under matrix_fsdp it ends this process group's usefulness.
    runs: dict = {}
    for strategy, how in (("ddp", "lone"), ("ddp", "full"), ("matrix_fsdp", "full"), ("matrix_fsdp", "lone")):
        torch.manual_seed(0)
        lit = SamplingLit(how)
        try:
            _trainer(strategy, **kw).fit(lit)
            runs[strategy, how] = (lit.samples, _weights(lit))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error", strategy, how] = f"{type(e).__name__}: {e}"
            out["lone", strategy, how] = lit.lone_error
    ddp, ours = runs["ddp", "full"], runs["matrix_fsdp", "full"]
    out["samples"] = [len(runs["ddp", "lone"][0]), len(ddp[0]), len(ours[0])]
    out["samples_differ"] = [i for i, ((a, la), (b, lb)) in enumerate(zip(ours[0], ddp[0]))
                             if not (torch.equal(a, b) and torch.equal(la, lb))]
    out["ddp_lone_differs"] = [i for i, (a, b) in enumerate(zip(runs["ddp", "lone"][0], ddp[0]))
                               if not torch.equal(a[1], b[1])]
    out["weights_differ"] = _differ(ours[1], ddp[1])
    return out


def test_rank_zero_forward_is_refused_within_seconds_and_full_model_samples_like_ddp():
    # processes of its own: the refused forward leaves their process group unusable
    res = run_distributed(_sampling_worker, WORLD, timeout=150)
    # full_model: rank 0 samples exactly what DDP's rank 0 samples (token ids and logits, at
    # both epochs), the other rank samples nothing, and training goes on as under DDP
    assert res[0]["samples"] == [2, 2, 2] and res[1]["samples"] == [0, 0, 0]
    assert res[0]["samples_differ"] == [] and res[0]["ddp_lone_differs"] == []
    for r in res:
        assert r["weights_differ"] == [], r["weights_differ"]
    # the rank-0-only forward: a clear error on rank 0 within seconds (the process-group timeout is 30 min)
    assert res[0]["error", "matrix_fsdp", "lone"].startswith("LoneForwardError"), res[0]["error", "matrix_fsdp", "lone"]
    message, elapsed = res[0]["lone", "matrix_fsdp", "lone"]
    assert "outside the Trainer's steps" in message and "full_model(module, rank=0)" in message
    assert "trainer.is_global_zero" in message
    assert elapsed < LONE_WAIT_S + 15, elapsed
    assert ("error", "matrix_fsdp", "lone") in res[1]  # the other rank stopped too (its peer left)


# ---------------------------------------------------------------------- 3. fit again after an exception
class FailingLit(LitTiny):
    """Raises inside block 0's forward at the step ``fail_at`` (None: never)."""

    fail_at: Any = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and len(self.losses) == self.fail_at:
            block = self.model.blocks[0]
            forward = block.forward

            def boom(x: torch.Tensor) -> torch.Tensor:
                block.forward = forward
                raise ValueError("user error in forward")

            block.forward = boom
        return super().training_step(batch, batch_idx)


def _refit_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp  # noqa: F401

    out = {}
    for strategy in ("ddp", "matrix_fsdp"):
        torch.manual_seed(0)
        lit = FailingLit()
        lit.fail_at = 2
        try:
            _trainer(strategy, max_steps=4).fit(lit)
            raised = None
        except ValueError as e:
            raised = str(e)
        lit.fail_at = None
        _trainer(strategy, max_steps=3).fit(lit)
        out[strategy] = (raised, lit.losses, _weights(lit))
    return {"raised": (out["ddp"][0], out["matrix_fsdp"][0]), "losses": (out["ddp"][1], out["matrix_fsdp"][1]),
            "differ": _differ(out["ddp"][2], out["matrix_fsdp"][2])}


def test_second_fit_after_an_exception_in_forward_equals_ddp(dist_pools):
    for r in dist_pools(WORLD).run(_refit_worker):
        assert r["raised"] == ("user error in forward",) * 2
        ddp_losses, losses = r["losses"]
        assert len(losses) == 5 and losses == ddp_losses  # 2 steps before the error, 3 in the second fit
        assert not r["differ"], r["differ"]


# ---------------------------------------------------------------------- 4. torch.save(trainer.model)
def _pickle_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf

    out: dict = {}
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    for strategy in ("ddp", "matrix_fsdp"):
        torch.manual_seed(0)
        lit = LitTiny()
        trainer = _trainer(strategy, max_steps=3)
        trainer.fit(lit)
        buf = io.BytesIO()
        try:
            torch.save(trainer.model, buf)
            out[strategy, "save"] = "ok"
        except TypeError as e:
            out[strategy, "save"] = str(e)
        with mf.full_model(lit, rank=0):  # under DDP: nothing to gather
            if rank == 0:
                buf = io.BytesIO()
                torch.save(lit, buf)
                buf.seek(0)
                loaded = torch.load(buf, weights_only=False)
                out[strategy, "loaded"] = {k: v.clone() for k, v in loaded.model.state_dict().items()}
                out[strategy, "logits"] = loaded.model(batch)
                out[strategy, "deepcopy"] = copy.deepcopy(lit).model(batch)
        out[strategy, "sharded_after"] = mf.is_matrix_sharded(lit)
    result = {k: v for k, v in out.items() if k[1] in ("save", "sharded_after")}
    if rank == 0:
        result["loaded_differ"] = _differ(out["ddp", "loaded"], out["matrix_fsdp", "loaded"])
        result["logits_equal"] = [torch.equal(out["ddp", "logits"], out[s, k]) for s, k in
                                  (("matrix_fsdp", "logits"), ("matrix_fsdp", "deepcopy"), ("ddp", "deepcopy"))]
    else:
        result["loaded"] = ("matrix_fsdp", "loaded") in out
    return result


def test_pickling_is_refused_clearly_and_full_model_pickles_what_ddp_pickles(dist_pools):
    res = dist_pools(WORLD).run(_pickle_worker)
    for r in res:
        assert r["ddp", "save"] == "ok"
        message = r["matrix_fsdp", "save"]
        assert message.startswith("cannot pickle a model sharded by lightning_matrixfsdp"), message
        for hint in ("trainer.save_checkpoint", "save_distributed_checkpoint=False", "lightning_matrixfsdp.consolidate",
                     "full_model(model, rank=0)"):
            assert hint in message
        assert r["matrix_fsdp", "sharded_after"] and not r["ddp", "sharded_after"]
    # inside full_model, rank 0 pickles a plain model: the same weights and outputs as DDP's
    assert res[0]["loaded_differ"] == [] and res[0]["logits_equal"] == [True, True, True]
    assert res[1]["loaded"] is False


# ---------------------------------------------------------------------- 5. logging gradient norms
class GradNormLit(LitTiny):
    """Logs every parameter's gradient norm before each step, as Lightning's docs suggest:
    ``lightning.pytorch.utilities.grad_norm`` under DDP, ``lightning_matrixfsdp.grad_norm``
    under matrix_fsdp (Lightning's would read each rank's local, owner-sharded gradients)."""

    def __init__(self, norm_fn: Any, norm_type: Any) -> None:
        super().__init__()
        self.norm_fn, self.norm_type = norm_fn, norm_type
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = self.norm_fn(self, norm_type=self.norm_type)
        self.log_dict(norms)
        self.norms.append({k: v.item() for k, v in norms.items()})


def _grad_norm_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp
    from lightning.pytorch.utilities import grad_norm

    out: dict[str, Any] = {}
    for norm_type in (2, "inf"):
        runs = {}
        for strategy, fn in (("ddp", grad_norm), ("matrix_fsdp", lightning_matrixfsdp.grad_norm),
                             ("matrix_fsdp_lightning_fn", grad_norm)):
            torch.manual_seed(0)
            lit = GradNormLit(fn, norm_type)
            _trainer(strategy.replace("_lightning_fn", ""), max_steps=3).fit(lit)
            runs[strategy] = lit.norms
        out[str(norm_type)] = runs
    return out


def test_grad_norm_logs_what_ddp_logs(dist_pools):
    """``lightning_matrixfsdp.grad_norm`` gives DDP's per-parameter and total norms, bitwise,
    on every rank; Lightning's own function on the sharded model does not (the control)."""
    for r in dist_pools(WORLD).run(_grad_norm_worker):
        for norm_type, runs in r.items():
            ddp, ours = runs["ddp"], runs["matrix_fsdp"]
            assert len(ddp) == 3 and ddp[0] and any(k.endswith("_total") for k in ddp[0])
            assert ours == ddp, norm_type
            assert runs["matrix_fsdp_lightning_fn"] != ddp  # local shards: zeros or missing entries
