"""The distributed QK-Clip scenarios of ``test_qk_clip_dist.py`` (gloo, float32).

* ``trainer_pair`` (2 ranks): the same LightningModule (a tiny Llama, GQA, q/k biases) and the
  same ``QKClip`` callback fitted under ``strategy="matrix_fsdp"`` and under Lightning's
  ``"ddp"``; returns both runs' whole weights and what the callback logged.
* ``sharded_vs_reference`` (2 ranks): ``matrix_shard`` + ``QKClipper`` + SGD on a Llama (GQA,
  biases), a Qwen3 (q/k norms) and the demos' GPT, and the Llama under torch's FSDP2
  (``fully_shard``: DTensor row shards), against the reference: a plain copy on
  every rank that computes every rank's batch itself, averages the gradients, steps SGD and
  applies Kimi K2's rule by hand with each head's maximum over *all* ranks' batches.
* ``four_ranks``: ``tp_vs_reference`` (data parallel 2 x tensor parallel 2): the Llama with its
  attention split by heads over the TP ranks (q/k/v colwise, o rowwise) under ``matrix_shard``,
  against the same reference (the unsplit model; TP sums o_proj in another order: a tolerance);
  ``tp_gpt_vs_reference``: the demos' GPT with ``TensorParallelGPT``'s plan, the same way;
  ``hsdp_vs_reference`` (2 replicas x 2, ``replica_split``): the same model and reference.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from helpers.models import batch_for, lm_loss
from helpers.qk_reference import Capture, build, clip_by_hand, logits_of, step_maxima

LAYER = {"llama": "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
         "qwen3": "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer",
         "gpt": "lightning_matrixfsdp.demos.gpt.Block"}
TAU = {"llama": 0.045, "qwen3": 2.4, "gpt": 0.04}  # between the heads' maxima of these tiny models
KW = {"llama": {"attention_bias": True}, "qwen3": {}, "gpt": {}}
LR = 0.5


# ---------------------------------------------------------------------- the reference
class Reference:
    """A plain copy trained as DDP + SGD would, with QK-Clip applied by hand after each step."""

    def __init__(self, model: torch.nn.Module, tau: float) -> None:
        self.model, self.tau = copy.deepcopy(model).train(), tau
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, batches: list[torch.Tensor]) -> dict[str, float]:
        cap = Capture(self.model)
        for x in batches:  # every rank's batch, in rank order: gradients summed as the reduction sums them
            lm_loss(logits_of(self.model, x), x).backward()
        cap.remove()
        maxima = step_maxima(cap)  # each head's maximum over every rank's batch, with the forward's weights
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad /= len(batches)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for m, s in maxima.items():
            clip_by_hand(m, s, self.tau)
        every = torch.cat(list(maxima.values()))
        return {"clipped": int((every > self.tau).sum()), "heads": every.numel()}


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import lightning_matrixfsdp as mf
    from torch.distributed.tensor import DTensor

    with mf.full_model(model, rank=None) as full:  # FSDP2's DTensors: gathered here
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in full.named_parameters()}


def _max_diff(ours: dict, ref: torch.nn.Module) -> tuple[float, str]:
    """The largest absolute difference of any weight from the reference's, and its name."""
    diffs = {n: (ours[n].double() - p.detach().double()).abs().max().item() for n, p in ref.named_parameters()}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


def _run(model, reference: Reference, name: str, data_rank: int, data_world: int, steps: int) -> dict:
    import lightning_matrixfsdp as mf

    clip = mf.QKClipper(model, tau=TAU[name])
    opt = mf.route_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    res: dict[str, Any] = {"diff": [], "where": [], "clipped": []}
    for step in range(steps):
        x = batch_for(step, data_rank)
        lm_loss(logits_of(model, x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clip.step()
        res["clipped"].append(reference.step([batch_for(step, r) for r in range(data_world)]))
        diff, where = _max_diff(_whole(model), reference.model)
        res["diff"].append(diff)
        res["where"].append(where)
    clip.remove()
    return res


def sharded_vs_reference(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.options import check_wrap_policy

    out = {}
    for name in ("llama", "qwen3", "gpt"):
        model = build(name, **KW[name]).train()
        reference = Reference(model, TAU[name])
        mf.matrix_shard(model, wrap_policy=check_wrap_policy(LAYER[name]))
        out[name] = _run(model, reference, name, rank, world, steps=2)
    # the same code under torch's FSDP2 (fully_shard: each rank holds a DTensor row shard)
    from torch.distributed.fsdp import fully_shard

    model = build("llama", **KW["llama"]).train()
    reference = Reference(model, TAU["llama"])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    out["fsdp2"] = _run(model, reference, "llama", rank, world, steps=2)
    return out


def four_ranks(rank: int, world: int) -> dict:
    """The 4-process scenarios in one task: tensor parallelism (a Llama, the demos' GPT), then HSDP
    with ``replica_split``."""
    return {"tp": tp_vs_reference(rank, world), "tp_gpt": tp_gpt_vs_reference(rank, world),
            "hsdp": hsdp_vs_reference(rank, world)}


def tp_gpt_vs_reference(rank: int, world: int) -> dict:
    """The demos' GPT with ``TensorParallelGPT``'s plan (the fused ``qkv`` colwise, its output
    gathered: every TP rank measures every head, and holds rows of q, k and v of some of them)."""
    import lightning_matrixfsdp as mf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from lightning_matrixfsdp.runtime.options import check_wrap_policy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = build("gpt").train()
    reference = Reference(model, TAU["gpt"])
    plan = {"attn.qkv": ColwiseParallel(output_layouts=Replicate()), "attn.proj": RowwiseParallel(input_layouts=Replicate())}
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], plan)
    mf.matrix_shard(model, mesh=mesh, wrap_policy=check_wrap_policy(LAYER["gpt"]))
    return _run(model, reference, "gpt", mesh.get_local_rank("data_parallel"), 2, steps=2)


def hsdp_vs_reference(rank: int, world: int) -> dict:
    """2 replicas x shard groups of 2 (``replica_split`` on by default: one replica steps each
    role and sends it to the other); the reference computes all four ranks' batches."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.options import check_wrap_policy

    model = build("llama", **KW["llama"]).train()
    reference = Reference(model, TAU["llama"])
    mf.matrix_shard(model, mesh=mf.hsdp_mesh(2), wrap_policy=check_wrap_policy(LAYER["llama"]))
    res = _run(model, reference, "llama", rank, world, steps=2)
    res["replica_split"] = mf.get_plan(model).replica_split
    return res


def tp_vs_reference(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from lightning_matrixfsdp.runtime.options import check_wrap_policy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = build("llama", **KW["llama"]).train()
    reference = Reference(model, TAU["llama"])
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh["tensor_parallel"], plan)
    mf.matrix_shard(model, mesh=mesh, wrap_policy=check_wrap_policy(LAYER["llama"]))
    data_rank = mesh.get_local_rank("data_parallel")
    res = _run(model, reference, "llama", data_rank, 2, steps=2)
    return res


# ---------------------------------------------------------------------- the Trainer, both strategies
def trainer_pair(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch import LightningModule

    import lightning_matrixfsdp as mf
    from helpers.lit import TokenData, cpu_trainer, full_numpy
    from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

    class LitLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("llama", **KW["llama"])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return lm_loss(logits_of(self.model, batch), batch)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenData(n=16), batch_size=2)

        def configure_optimizers(self) -> Any:
            a = ADAMW_DEFAULTS
            # the Muon recipe built from the module: the same roles under DDP and matrix_fsdp
            return mf.Muon(self, adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)

    out: dict[str, Any] = {}
    for key, strategy in (("ddp", "ddp"), ("mf", mf.MatrixFSDPStrategy(log_plan=False))):
        lit = LitLM()
        callback = mf.QKClip(tau=TAU["llama"])
        trainer = cpu_trainer(strategy, world, root, max_steps=3, limit_val_batches=0, callbacks=[callback])
        trainer.fit(lit)
        out[key] = {"weights": full_numpy(lit), "logged": sorted(k for k in trainer.callback_metrics
                                                                         if k.startswith("qk_clip/")),
                    "clipped": float(trainer.callback_metrics["qk_clip/clipped_heads"]),
                    "detached": callback.clipper is None}
    return out

