"""Expert parallelism (``expert_parallel_size``) on a tiny Hugging Face Mixtral, CPU gloo, float64.

The oracle is one process per rank that holds the whole model and is fed every rank's batch
(DDP's loss: the mean of the ranks' losses), stepped by ``torch.optim.Muon`` on separate 2-D
parameters (every dense matrix, and each expert's ``gate``, ``up`` and ``down`` matrices as
parameters of their own) and ``torch.optim.AdamW`` on the rest. Written here, independent of
the runtime. One task per world size runs every scenario, on the session's warm Hugging Face pools
(``hf_pool``, ``hf_pool4``: tests/conftest.py).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist import PoolTask
from helpers.equiv import count_collectives
from helpers.models import GroupedMoE

pytest.importorskip("transformers")
# the first test of each launch waits for the whole launch (a loaded 2-core machine: minutes)
pytestmark = pytest.mark.timeout(900)

STEPS = 10
LR, WD, ADAM_LR = 0.02, 0.1, 0.01
MAX_NORM = 0.5
#: float64: Muon's Newton-Schulz runs in bfloat16 (torch's and ours), where a float32 difference in the
#: last bit of a gradient (the experts' outputs are summed in another order than Hugging Face's loop)
#: can flip a rounding and the trajectories drift apart; float64's differences flip none.
DTYPE = torch.float64
TOL = 1e-9


def tiny_mixtral(experts: int = 4, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
                        router_aux_loss_coef=0.05, tie_word_embeddings=False, experts_implementation="eager")
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg).to(DTYPE)


class TinyGrouped(torch.nn.Module):
    """A token model of two ``GroupedMoE`` blocks; ``parallelize_experts`` applied as in configure_model."""

    def __init__(self, experts: int) -> None:
        import lightning_matrixfsdp as mf

        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(GroupedMoE(16, experts) for _ in range(2))
        self.head = torch.nn.Linear(16, 64, bias=False)
        for block in self.blocks:
            mf.parallelize_experts(block.experts)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)[:, :-1]
        return SimpleNamespace(loss=F.cross_entropy(logits.reshape(-1, 64), labels[:, 1:].reshape(-1)))


def tiny_grouped(experts: int = 4, seed: int = 0) -> TinyGrouped:
    torch.manual_seed(seed)
    return TinyGrouped(experts).to(DTYPE)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 64, (2, 8), generator=g)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # the load-balancing loss included


# ---------------------------------------------------------------------- the oracle
class Oracle:
    """The whole model in one process, each expert matrix a 2-D parameter of its own for Muon."""

    def __init__(self, experts: int, matrices: set[str], build=None) -> None:
        """``matrices``: the names Muon steps (the rest: AdamW), as the sharded run chose them."""
        self.model = (build or tiny_mixtral)(experts)
        self.pieces: list[tuple[torch.Tensor, slice, torch.nn.Parameter]] = []  # (stack, rows, matrix)
        dense, rest = [], []
        for name, p in self.model.named_parameters():
            if name not in matrices:
                rest.append(p)
            elif p.ndim == 3:
                half = p.shape[1] // 2
                rows = [slice(0, half), slice(half, p.shape[1])] if name.endswith("gate_up_proj") else [slice(None)]
                for e in range(p.shape[0]):
                    for r in rows:
                        self.pieces.append((p, (e, r), torch.nn.Parameter(p.data[e, r].clone())))
            else:
                dense.append(p)
        self.muon = torch.optim.Muon(dense + [m for *_, m in self.pieces], lr=LR, weight_decay=WD)
        self.adamw = torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=WD)

    def step(self, batches: list[torch.Tensor], clip: bool) -> tuple[float, float]:
        self.model.zero_grad()
        loss = sum(loss_of(self.model, b) for b in batches) / len(batches)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM) if clip else torch.tensor(0.0)
        for stack, (e, r), m in self.pieces:
            m.grad = stack.grad[e, r].clone()
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for stack, (e, r), m in self.pieces:
                stack[e, r] = m
        return loss.item(), norm.item()


# ---------------------------------------------------------------------- the sharded side
def gathered(model) -> dict[str, torch.Tensor]:
    """Every dense parameter whole (broadcast from its owner) and every local expert slice as held."""
    from lightning_matrixfsdp.runtime import sync_replicas
    from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, shard_of, state_of

    sync_replicas(model)  # HSDP's replica_split: the other replicas take the stepping replica's update
    sg = state_of(model).sg
    out = {}
    for name, p in model.named_parameters():
        if expert_slice_of(p) is not None:
            out[name] = p.detach().clone()
            continue
        shard = shard_of(p)
        t = p.data.clone() if is_owned(p) else torch.empty(shard.shape, dtype=p.dtype)
        dist.broadcast(t, src=sg.g(shard.owner), group=sg.group)
        out[name] = t
    return out


def matrix_names(model) -> set[str]:
    """The parameters the sharded run steps with Muon: the recipe's matrices (hidden matrices and
    expert stacks), which its optimizer, built from the module, follows."""
    from lightning_matrixfsdp.runtime.tags import recipe_of

    return {n for n, p in model.named_parameters() if recipe_of(p).is_matrix}


def sharded(experts: int, ep: int, build=None, **options):
    import lightning_matrixfsdp as mf

    model = (build or tiny_mixtral)(experts)
    mf.matrix_shard(model, expert_parallel_size=ep, **options)
    opt = mf.route_optimizer(mf.Muon(model, lr=LR, weight_decay=WD, adamw_lr=ADAM_LR,
                                     adamw_weight_decay=WD))
    return model, opt


def every_slice(model) -> dict[str, list[torch.Tensor]]:
    """Every rank's expert slices (or gradients' slices), by name, in global rank order."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    out = {}
    for name, p in model.named_parameters():
        if expert_slice_of(p) is not None:
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.detach().contiguous())
            out[name] = parts
    return out


def train_against_oracle(rank: int, world: int, experts: int, ep: int, clip: bool, build=None, **options) -> dict:
    """``STEPS`` steps of the expert-parallel model beside the oracle (run on rank 0 alone, which
    compares every rank's experts); the largest differences, the same dict on every rank."""
    import lightning_matrixfsdp as mf

    model, opt = sharded(experts, ep, build, **options)
    oracle = Oracle(experts, matrix_names(model), build) if rank == 0 else None
    count = experts // ep
    worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0, "expert_grad": 0.0}
    step_calls = 0

    def experts_apart(slices: dict[str, list[torch.Tensor]], ref_of) -> float:
        """The largest difference of any rank's expert slice from the oracle's (rank r: experts of place r % EP)."""
        return max((parts[r] - ref_of(name)[(r % ep) * count:(r % ep + 1) * count]).abs().max().item()
                   for name, parts in slices.items() for r in range(world))

    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        if clip:  # grad_norm's total (each expert counted once) is the norm the clip reports
            total = mf.grad_norm(model, 2)["grad_2.0_norm_total"]
        norm = mf.clip_grad_norm_(model, MAX_NORM) if clip else torch.tensor(0.0)
        if clip:
            worst["grad_norm"] = max(worst.get("grad_norm", 0.0), abs(total.item() - norm.item()))
        with count_collectives() as seen:
            opt.step()
        step_calls += seen.calls
        losses = [torch.zeros(1, dtype=loss.dtype) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        grads = {}
        if step == 0:  # the expert gradients (after clipping, as the optimizer read them)
            from lightning_matrixfsdp.runtime.tags import expert_slice_of

            for name, p in model.named_parameters():
                if expert_slice_of(p) is not None:
                    parts = [torch.empty_like(p.grad) for _ in range(world)]
                    dist.all_gather(parts, p.grad.contiguous())
                    grads[name] = parts
        if oracle is not None:
            ref_loss, ref_norm = oracle.step([batch(step, r) for r in range(world)], clip)
            worst["loss"] = max(worst["loss"], abs(sum(x.item() for x in losses) / world - ref_loss))
            worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm))
            if grads:
                refs = dict(oracle.model.named_parameters())
                worst["expert_grad"] = experts_apart(grads, lambda n: refs[n].grad)
    dense, slices = gathered(model), every_slice(model)
    calls = torch.tensor([float(step_calls)], dtype=torch.float64)
    dist.all_reduce(calls)
    if oracle is not None:
        refs = dict(oracle.model.named_parameters())
        worst["weights"] = max(experts_apart(slices, lambda n: refs[n].detach()),
                               max((t - refs[n].detach()).abs().max().item() for n, t in dense.items()
                                   if n not in slices))
        start = dict((build or tiny_mixtral)(experts).named_parameters())
        worst["moved"] = min((refs[n].detach() - start[n].detach()).abs().max().item()
                             for n, p in refs.items() if p.ndim == 3)  # every expert stack trained
    worst["step_collectives"] = int(calls.item())
    box = [worst]
    dist.broadcast_object_list(box)
    return box[0]


def refusals(rank: int, world: int) -> dict:
    """Each refusal raises MatrixShardError on every rank, within seconds; the message of each."""
    import lightning_matrixfsdp as mf

    out = {}
    cases = {
        "indivisible_experts": lambda: mf.matrix_shard(tiny_mixtral(experts=3), expert_parallel_size=2),
        "ep_not_dividing_world": lambda: mf.matrix_shard(tiny_mixtral(), expert_parallel_size=3),
        "experts_differ": lambda: mf.matrix_shard(tiny_mixtral(experts=4 if rank == 0 else 2),
                                                  expert_parallel_size=2),
        "tensor_parallel": lambda: mf.matrix_shard(tiny_mixtral(), mesh=_tp_mesh(), expert_parallel_size=2),
    }
    for name, build in cases.items():
        start = time.monotonic()
        try:
            build()
            out[name] = ("no error", 0.0)
        except mf.MatrixShardError as e:
            out[name] = (str(e), time.monotonic() - start)
        dist.barrier()
    # no longer refused: a meta-device Hugging Face model shards with EP (its experts uninitialized, as
    # a one-process meta-device initialization leaves them; tests/test_moe_ep_ckpt.py checks the values)
    model = _meta_mixtral()
    mf.matrix_shard(model, expert_parallel_size=2)
    out["meta_shards"] = all(not p.is_meta for p in model.parameters())
    return out


def checkpoints(rank: int, world: int) -> dict:
    """Save at EP=2 after 3 steps (a directory and a consolidated file); then: resume at EP=2 (bitwise
    the uninterrupted run), load at EP=1 (no expert parallelism) and keep training (the same run in
    float64), the consolidated file and the safetensors export in Hugging Face's keys and layout."""
    import os
    import shutil
    import tempfile

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import save_sharded
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
    from lightning_matrixfsdp.checkpoint.export import export_safetensors

    box = [tempfile.mkdtemp(prefix="moe_ep_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    root = box[0]

    def run(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            opt.step()

    def whole(model) -> dict[str, torch.Tensor]:
        """Every parameter whole on every rank (expert slices gathered over the expert-parallel group)."""
        from lightning_matrixfsdp.runtime.tags import expert_slice_of

        out = gathered(model)
        for name, p in model.named_parameters():
            s = expert_slice_of(p)
            if s is not None:
                parts = [torch.empty_like(out[name]) for _ in range(world)]
                dist.all_gather(parts, out[name])
                out[name] = torch.cat(parts[:s.groups.ep_size])  # the first expert-parallel group's ranks
        return out

    out = {}
    model, opt = sharded(4, 2)
    run(model, opt, range(3))
    save_sharded(model, os.path.join(root, "dir"), [opt])
    save_sharded(model, os.path.join(root, "file.ckpt"), [opt], full=True)
    saver = AsyncCheckpointer()
    saver.save_sharded(model, os.path.join(root, "async"), [opt])  # written while training goes on
    at_save = whole(model)
    run(model, opt, range(3, 6))
    saver.wait()
    saver.close()
    uninterrupted = whole(model)

    resumed, ropt = sharded(4, 2)
    run(resumed, ropt, range(1))  # some other state first: the load must replace it all
    mf.load_sharded(resumed, os.path.join(root, "dir"), [ropt])
    run(resumed, ropt, range(3, 6))
    got = whole(resumed)
    out["resume_ep2_bitwise"] = all(torch.equal(got[k], uninterrupted[k]) for k in got)
    mf.load_sharded(resumed, os.path.join(root, "async"), [ropt])
    got = whole(resumed)
    out["async_equal"] = all(torch.equal(got[k], at_save[k]) for k in got)

    plain, popt = sharded(4, 1)
    mf.load_sharded(plain, os.path.join(root, "dir"), [popt])
    loaded = whole(plain)
    out["load_ep1_weights_equal"] = all(torch.equal(loaded[k], at_save[k]) for k in loaded)
    run(plain, popt, range(3, 6))
    got = whole(plain)
    out["ep1_continues"] = max((got[k] - uninterrupted[k]).abs().max().item() for k in got)

    if rank == 0:
        ck = torch.load(os.path.join(root, "file.ckpt"), map_location="cpu", weights_only=False)
        sd = ck["state_dict"]
        reference = tiny_mixtral(4)
        reference.load_state_dict(sd)  # Hugging Face's own keys and shapes, no EP anywhere
        out["file_equal"] = all(torch.equal(sd[k], at_save[k]) for k in at_save)
        export_safetensors(os.path.join(root, "dir"), os.path.join(root, "hf"))
        from safetensors.torch import load_file

        st = load_file(os.path.join(root, "hf", "model.safetensors"))
        out["safetensors_equal"] = sorted(st) == sorted(at_save) and all(torch.equal(st[k], at_save[k])
                                                                          for k in at_save)
    dist.barrier()
    fresh, _ = sharded(4, 2)  # Hugging Face's safetensors into an EP=2 model: each rank reads its experts
    mf.load_pretrained(fresh, os.path.join(root, "hf"))
    got = whole(fresh)
    out["pretrained_equal"] = all(torch.equal(got[k], at_save[k]) for k in got)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _meta_mixtral():
    with torch.device("meta"):
        return tiny_mixtral()


# ---------------------------------------------------------------------- launches
def _world2(rank: int, world: int) -> dict:
    return {
        "ep2": train_against_oracle(rank, world, experts=4, ep=2, clip=True),
        "grouped": train_against_oracle(rank, world, experts=4, ep=2, clip=True, build=tiny_grouped),
        "refusals": refusals(rank, world),
        "checkpoints": checkpoints(rank, world),
    }


def _world4(rank: int, world: int) -> dict:
    return {
        "ep2": train_against_oracle(rank, world, experts=4, ep=2, clip=True),
        "ep4": train_against_oracle(rank, world, experts=4, ep=4, clip=False),
        "ep2_hsdp": train_against_oracle(rank, world, experts=4, ep=2, clip=True, shard_size=2),
    }


WORLD2 = PoolTask(_world2, timeout=600)  # on hf_pool (tests/conftest.py): warm, transformers imported
WORLD4 = PoolTask(_world4, timeout=600)  # on hf_pool4 (tests/conftest.py), shared with test_moe_hf


def _check_training(result: dict) -> None:
    assert result["step_collectives"] == 0, "optimizer.step() communicated"
    assert result["moved"] > 1e-3, "the weights did not train"
    assert result["loss"] < 1e-5, result  # Hugging Face computes the loss in float32 (its last bits)
    assert result["norm"] < TOL, result
    assert result.get("grad_norm", 0.0) < 1e-5, result  # float32 per-parameter norms in the total
    assert result["expert_grad"] < TOL, result
    assert result["weights"] < TOL, result


def test_ep2_world2_equals_one_process_oracle(hf_pool):
    for r in WORLD2.results(hf_pool):
        _check_training(r["ep2"])


def test_grouped_experts_style_equals_one_process_oracle(hf_pool):
    for r in WORLD2.results(hf_pool):
        _check_training(r["grouped"])


def test_refusals_on_every_rank_within_seconds(hf_pool):
    results = [r["refusals"] for r in WORLD2.results(hf_pool)]
    expected = {"indivisible_experts": "does not divide the 3 experts", "ep_not_dividing_world": "must divide",
                "experts_differ": "differ across ranks", "tensor_parallel": "with tensor parallelism"}
    for per_rank in results:
        assert per_rank.pop("meta_shards"), "a meta-device model with expert parallelism did not shard"
        for name, words in expected.items():
            message, seconds = per_rank[name]
            assert words in message, (name, message)
            assert seconds < 10, (name, seconds)


def test_expert_gradient_is_divided_by_the_data_parallel_size(hf_pool4):
    # world 4, EP=2: the data-parallel size (4) differs from EP (2), so dividing by EP would fail here;
    # every rank's expert gradients after the first backward (and the clip) against the oracle's
    for r in WORLD4.results(hf_pool4):
        assert r["ep2"]["expert_grad"] < TOL, r["ep2"]


def test_checkpoints_resume_at_ep2_async_and_load_without_expert_parallelism(hf_pool):
    for rank, r in enumerate(WORLD2.results(hf_pool)):
        c = r["checkpoints"]
        assert c["resume_ep2_bitwise"] and c["load_ep1_weights_equal"] and c["async_equal"], c
        assert c["ep1_continues"] < TOL and c["pretrained_equal"], c
        if rank == 0:
            assert c["file_equal"] and c["safetensors_equal"], c


@pytest.mark.parametrize("scenario", ["ep2", "ep4", "ep2_hsdp"])
def test_world4_equals_one_process_oracle(scenario, hf_pool4):
    for r in WORLD4.results(hf_pool4):
        _check_training(r[scenario]) if scenario != "ep4" else _check_training({**r[scenario], "norm": 0.0})
