"""GPT-OSS experts: declared automatically and stepped as the separate ``nn.Linear`` weights they are.

GPT-OSS stores each layer's experts transposed, ``x @ W``: ``gate_up_proj [E, H, 2I]`` with gate
and up interleaved along the last dimension (gate ``[..., ::2]``, up ``[..., 1::2]``) and
``down_proj [E, I, H]``. As ``nn.Linear`` weights (``[out, in]``) expert ``e`` is three matrices:
``gate = gate_up_proj[e][:, ::2].T`` ``(I, H)``, ``up = gate_up_proj[e][:, 1::2].T`` ``(I, H)`` and
``down = down_proj[e].T`` ``(H, I)``. The oracle, written plainly here, is ``torch.optim.Muon`` on
those separate 2-D tensors (its learning-rate adjustment read from their ``(out, in)`` shapes),
and the Shampoo/SOAP wrappers on them one instance per matrix. ``H != I`` throughout, so an
adjustment read from the stored orientation would differ. CPU, float32, every comparison bitwise.
"""
from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from helpers.dist import OneLaunch
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack, ExpertStackError, declared_stacks
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import tag_stack

E, H, I = 3, 8, 5  # experts, hidden size, intermediate size (H != I: the orientation matters)
GATE_UP = ExpertStack(E, (I, I), transposed=True, interleaved=True)
DOWN = ExpertStack(E, (H,), transposed=True)


def _linear_weights(gate_up: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
    """Expert by expert: gate, up, down as nn.Linear weights [out, in] (copies)."""
    out = []
    for e in range(gate_up.shape[0]):
        out += [gate_up[e][:, 0::2].T.contiguous(), gate_up[e][:, 1::2].T.contiguous(), down[e].T.contiguous()]
    return out


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g)
    a, b = nn.Parameter(gate_up.clone()), nn.Parameter(down.clone())
    tag_stack(a, GATE_UP)
    tag_stack(b, DOWN)
    separate = [nn.Parameter(w) for w in _linear_weights(gate_up, down)]
    return a, b, separate


def _feed(a, b, separate, seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ga, gb = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g)
        a.grad, b.grad = ga.clone(), gb.clone()
        for q, w in zip(separate, _linear_weights(ga, gb)):
            q.grad = w
        yield


MUON_CASES = {
    "default_adjust": dict(lr=0.02),
    "match_rms_adamw": dict(lr=0.02, adjust_lr_fn="match_rms_adamw"),
    "no_nesterov": dict(lr=0.01, nesterov=False, weight_decay=0.0),
}


@pytest.mark.parametrize("case", sorted(MUON_CASES))
def test_gptoss_stacks_step_as_torch_muon_on_the_separate_linear_weights(case):
    kw = MUON_CASES[case]
    a, b, separate = _setup(seed=1)
    ours = Muon([{"params": [a, b], "role": "matrix"}], **kw)
    ref = torch.optim.Muon(separate, **kw)
    for _ in _feed(a, b, separate, seed=2, steps=3):
        ours.step()
        ref.step()
        mine = _linear_weights(a.data, b.data)
        bufs = _linear_weights(ours.state[a]["momentum_buffer"], ours.state[b]["momentum_buffer"])
        for k, q in enumerate(separate):
            assert torch.equal(mine[k], q.data), (case, "weight", divmod(k, 3))
            assert torch.equal(bufs[k], ref.state[q]["momentum_buffer"]), (case, "momentum", divmod(k, 3))


def test_gptoss_stacks_on_the_whole_stack_path_equal_the_separate_linear_weights():
    """``orthogonalizer="batched"`` takes the whole-stack path (a stack's pieces viewed in place as
    ``[-1, rows, cols]``) wherever it applies, on CPU too: a transposed, interleaved stack must not
    be viewed that way. The oracle is the same optimizer on the separate (out, in) matrices."""
    a, b, separate = _setup(seed=5)
    ours = Muon([{"params": [a, b], "role": "matrix"}], lr=0.02, orthogonalizer="batched")
    ref = Muon(separate, lr=0.02, orthogonalizer="batched")
    for _ in _feed(a, b, separate, seed=6, steps=2):
        ours.step()
        ref.step()
        for mine, theirs in zip(_linear_weights(a.data, b.data), separate):
            assert torch.equal(mine, theirs.data)


@pytest.mark.parametrize("transposed,interleaved", [(False, True), (True, False)])
def test_the_other_layout_combinations_step_as_torch_muon(transposed, interleaved):
    """A user's own stacks: interleaved rows stored [E, out, in], and contiguous blocks stored
    [E, in, out]; the (out, in) matrices cut plainly: W = p[e] or p[e].T, block j = W[j::2] or
    W[j*I:(j+1)*I]."""
    g = torch.Generator().manual_seed(7)
    shape = (E, H, 2 * I) if transposed else (E, 2 * I, H)
    w = torch.randn(shape, generator=g)
    stack = nn.Parameter(w.clone())
    tag_stack(stack, ExpertStack(E, (I, I), transposed, interleaved))

    def cut(t: torch.Tensor) -> list[torch.Tensor]:
        mats = [t[e].T if transposed else t[e] for e in range(E)]
        rows = [slice(0, None, 2), slice(1, None, 2)] if interleaved else [slice(0, I), slice(I, 2 * I)]
        return [m[r].contiguous() for m in mats for r in rows]

    separate = [nn.Parameter(m) for m in cut(w)]
    ours, ref = Muon([{"params": [stack], "role": "matrix"}], lr=0.02), torch.optim.Muon(separate, lr=0.02)
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        stack.grad = grad.clone()
        for q, m in zip(separate, cut(grad)):
            q.grad = m
        ours.step()
        ref.step()
    for k, (mine, q) in enumerate(zip(cut(stack.data), separate)):
        assert torch.equal(mine, q.data), k


LIB_CASES = {
    "soap": ("SOAP", dict(lr=0.01, precondition_frequency=2)),
    "shampoo": ("Shampoo", dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                block_size=4, graft_type="rmsprop", use_svd=True)),
}


@pytest.mark.parametrize("case", sorted(LIB_CASES))
def test_gptoss_stacks_shampoo_soap_equal_one_instance_per_linear_weight(case):
    """State per expert, in nn.Linear's orientation (out, in): entry ``e`` of each stacked state
    tensor equals the state of a separate instance on that expert's (out, in) matrix."""
    pytest.importorskip("pytorch_optimizer")
    from lightning_matrixfsdp.optim import matrix_optimizers

    name, kw = LIB_CASES[case]
    cls = getattr(matrix_optimizers, name)
    a, b, separate = _setup(seed=5)
    ours = cls([{"params": [a, b], "role": "matrix"}], **kw)
    refs = [cls([q], **kw) for q in separate]
    for _ in _feed(a, b, separate, seed=6, steps=3):
        for r in refs:
            r.step()
        ours.step()
    mine = _linear_weights(a.data, b.data)
    for k, (q, r) in enumerate(zip(separate, refs)):
        e, which = divmod(k, 3)
        assert torch.equal(mine[k], q.data), (case, e, which)
        state = ours.state[a] if which < 2 else ours.state[b]
        prefix = f"block{which}/" if which < 2 else ""
        for key, value in r.state[q].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(state[prefix + key][e], value), (case, key, e, which)


# ---------------------------------------------------------------------- the declaration
def test_layout_fields_are_validated_and_serialized_only_when_set():
    plain = ExpertStack(4, (6, 6))
    assert plain.to_dict() == {"num_experts": 4, "blocks": [6, 6]}  # unchanged: earlier plans' digests hold
    assert ExpertStack.from_dict(plain.to_dict()) == plain
    assert GATE_UP.to_dict() == {"num_experts": E, "blocks": [I, I], "transposed": True, "interleaved": True}
    assert ExpertStack.from_dict(GATE_UP.to_dict()) == GATE_UP
    assert GATE_UP.matrix_shapes((E, H, 2 * I)) == [(I, H), (I, H)] and DOWN.matrix_shapes((E, I, H)) == [(H, I)]
    assert "2 interleaved blocks (5, 5), stored transposed [E, in, out]" in GATE_UP.describe()
    for kw, why in ((dict(transposed=1), r"transposed must be True or False, got 1"),
                    (dict(interleaved="yes"), r"interleaved must be True or False"),
                    (dict(blocks=(2, 3), interleaved=True), r"interleaved needs at least two equal blocks"),
                    (dict(blocks=(5,), interleaved=True), r"interleaved needs at least two equal blocks")):
        with pytest.raises(ExpertStackError, match=why):
            ExpertStack(**{"num_experts": 2, "blocks": (5, 5), **kw})
    with pytest.raises(ExpertStackError, match="transposed must be True or False"):
        ExpertStack.from_dict({"num_experts": 2, "blocks": [3], "transposed": "yes"})
    with pytest.raises(ExpertStackError, match=r"does not fit .* cols \(stored transposed"):
        GATE_UP.check("w", (E, 2 * I, H))  # the F.linear layout declared as transposed


def _tiny_gptoss(layers: int = 1, experts: int = 2, hidden: int = 8, inter: int = 6, vocab: int = 32,
                 **extra: Any) -> nn.Module:
    import transformers as T

    cfg = T.GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, head_dim=4,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)
    return T.GptOssForCausalLM(cfg)


def test_gptoss_is_declared_automatically_biases_on_adamw_and_priced_per_linear_matrix():
    pytest.importorskip("transformers")
    from lightning_matrixfsdp.runtime.classify import UndeclaredStackWarning
    from lightning_matrixfsdp.runtime.roles import newton_schulz_flops
    from lightning_matrixfsdp.runtime.shard import collect

    model = _tiny_gptoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndeclaredStackWarning)
        collected = collect(model, MatrixFSDPConfig())
    roles = {p.fqn: (p.is_matrix, p.stack) for u in collected.specs for p in u.params}
    base = "model.layers.0.mlp.experts."
    assert roles[base + "gate_up_proj"] == (True, ExpertStack(2, (6, 6), True, True))
    assert roles[base + "down_proj"] == (True, ExpertStack(2, (8,), True))
    # placed as 2-D matrix roles (whole on an owner); the recipe of Muon(model) trains them with AdamW
    assert roles[base + "gate_up_proj_bias"] == (True, None) and roles[base + "down_proj_bias"] == (True, None)
    recipe = collected.recipe
    assert not recipe[base + "gate_up_proj_bias"].is_matrix and not recipe[base + "down_proj_bias"].is_matrix
    assert "per-expert bias" in recipe[base + "down_proj_bias"].reason
    assert recipe[base + "gate_up_proj"].is_matrix and recipe[base + "gate_up_proj"].stack == roles[base + "gate_up_proj"][1]
    # the planner's price: per expert, the (out, in) matrices gate (6, 8), up (6, 8), down (8, 6)
    ns = newton_schulz_flops
    assert ns((2, 8, 12), 5, roles[base + "gate_up_proj"][1]) == 2 * 2 * ns((6, 8))
    assert ns((2, 8, 12), 5, roles[base + "gate_up_proj"][1]) != 2 * 2 * ns((6, 12))  # not the stored columns
    assert ns((2, 6, 8), 5, roles[base + "down_proj"][1]) == 2 * ns((8, 6))
    # the option's mapping form declares the same layout for a user's own module
    option = MatrixFSDPConfig(expert_stacks={
        "*.experts.gate_up_proj": {"blocks": 2, "transposed": True, "interleaved": True},
        "*.experts.down_proj": {"transposed": True}}).expert_stacks
    assert {k: v[0] for k, v in declared_stacks(model, option).items()} == {
        k: v[0] for k, v in declared_stacks(model).items()}


def test_expert_stacks_mapping_form_is_checked():
    for bad, why in (({"w": {"blocks": 2, "transposed": 1}}, r"'transposed' is 1 \(int\)"),
                     ({"w": {"blocks": 2, "sideways": True}}, r"unknown key\(s\) \['sideways'\]"),
                     ({"w": {"interleaved": True}}, r"'interleaved' needs 'blocks' of at least two equal"),
                     ({"w": {"blocks": [2, 3], "interleaved": True}}, "at least two equal"),
                     ({"w": {"blocks": {"a": 1}}}, "'blocks' is a dict"),
                     ({"w": {"blocks": 0}}, "the blocks of pattern 'w'")):
        with pytest.raises(MatrixShardError, match=why):
            MatrixFSDPConfig(expert_stacks=bad)
    pytest.importorskip("transformers")
    from lightning_matrixfsdp.runtime.shard import collect

    with pytest.raises(MatrixShardError, match=r"out features \(the last dimension: stored transposed\) 16\) into 3 "):
        collect(_tiny_gptoss(hidden=16, inter=12), MatrixFSDPConfig(
            expert_stacks={"*.experts.down_proj": {"blocks": 3, "transposed": True}}))


# ---------------------------------------------------------------------- the model, 2 processes
VOCAB, STEPS = 64, 3


# ------------------------------------------------ the local experts as grouped GEMMs (gptoss_seam.py)
GROUPED_COUNTS = [3, 0, 6, 2]  # expert 1 receives no row


def _experts_module(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A Hugging Face GptOssExperts (4 experts, H = I = 8) with random weights and biases, and a
    small ``limit`` and another ``alpha`` so that both clamps bite (checked by the test)."""
    import transformers as T
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = T.GptOssConfig(vocab_size=16, hidden_size=8, intermediate_size=8, head_dim=4, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=len(GROUPED_COUNTS))
    module = GptOssExperts(cfg).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    module.alpha, module.limit = 1.3, 1.5
    return module


def _eager_loop(module: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The oracle: transformers' own per-expert loop (under its implementation switch), every
    row routed once, to its expert, with weight 1."""
    own = type(module).forward
    own = getattr(own, "__wrapped__", own)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return own(module, x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype))


def _out_and_grads(fn, module: nn.Module, x: torch.Tensor, seed: int = 1) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype))
    return {"out": out.detach(), "x": x.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}


def _cpu_grouped_mm_works() -> bool:
    import torch.nn.functional as F
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(2, 8, 8, requires_grad=True)
        F.grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32)).backward(torch.randn(4, 8))
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("mm", ["per_expert_mm", "F.grouped_mm"])
def test_gptoss_grouped_experts_equal_the_modules_eager_loop(mm):
    """gptoss_experts_forward (GPT-OSS's layout, biases, interleaved gate/up, clamped SwiGLU around
    two grouped matmuls) against Hugging Face's eager loop: output and the gradients of the input
    and of all four parameters, with an expert that gets no row (its gradients exact zeros).
    float64 with the plain per-expert matmul standing in for the grouped GEMM; float32 with torch's
    own F.grouped_mm on CPU, where it runs. Dropping a bias, taking gate/up as halves instead of
    interleaved, or a wrong clamp or alpha fails here."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from lightning_matrixfsdp.runtime.experts.gptoss import gptoss_experts_forward, per_expert_mm

    if mm == "F.grouped_mm" and not _cpu_grouped_mm_works():
        pytest.skip("this torch's F.grouped_mm does not run forward and backward on CPU")
    dtype, tol = (torch.float64, 1e-12) if mm == "per_expert_mm" else (torch.float32, 1e-5)
    module = _experts_module(dtype)
    x = torch.randn(sum(GROUPED_COUNTS), 8, generator=torch.Generator().manual_seed(2), dtype=dtype)
    with torch.no_grad():  # both clamps bite somewhere, so a wrong clamp shows
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor(GROUPED_COUNTS))
        pre = torch.einsum("sh,shn->sn", x, module.gate_up_proj[ids]) + module.gate_up_proj_bias[ids]
        assert (pre[:, ::2] > module.limit).any() and (pre[:, 1::2] < -module.limit).any()
        assert (pre[:, 1::2] > module.limit).any()

    want = _out_and_grads(lambda t: _eager_loop(module, t, GROUPED_COUNTS), module, x)
    fn = per_expert_mm if mm == "per_expert_mm" else F.grouped_mm
    got = _out_and_grads(lambda t: gptoss_experts_forward(
        t, GROUPED_COUNTS, module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias,
        module.alpha, module.limit, mm=fn), module, x)
    assert sorted(got) == ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias", "out", "x"]
    for k in want:
        err = (got[k] - want[k]).abs().max().item() / max(want[k].abs().max().item(), 1e-30)
        assert err < tol, (k, err)
    for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert got[k][1].abs().max().item() == 0.0 and got[k][0].abs().max().item() > 0, k
    # a rank that receives no row at all: an empty output, every gradient exact zeros (not None)
    none = _out_and_grads(lambda t: gptoss_experts_forward(
        t, [0] * 4, module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias,
        module.alpha, module.limit, mm=fn), module, x[:0])
    assert none["out"].shape == (0, 8) and all(not none[k].any() for k in none), none


def test_gptoss_seam_runs_the_grouped_forward_where_grouped_mm_serves(monkeypatch):
    """install_gptoss_forward's local computation takes gptoss_experts_forward (two grouped
    matmuls, the parameters passed in their order) where grouped_mm_available holds, and the
    module's eager loop elsewhere (here: the CPU); both equal the loop. The grouped GEMM is
    stood in for by a counting per-expert matmul, so this runs on any torch."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from lightning_matrixfsdp.runtime.experts import gptoss as gptoss_seam

    module = _experts_module(torch.float64, seed=3)
    x = torch.randn(sum(GROUPED_COUNTS), 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = _out_and_grads(lambda t: _eager_loop(module, t, GROUPED_COUNTS), module, x)
    local = gptoss_seam.install_gptoss_forward(module, 4, lambda *a: None, None)
    calls: list[tuple[int, ...]] = []

    def counting(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(w.shape))
        return gptoss_seam.per_expert_mm(a, w, offs)

    monkeypatch.setattr(F, "grouped_mm", counting, raising=False)
    eager = _out_and_grads(lambda t: local(t, GROUPED_COUNTS), module, x)
    assert calls == []  # CPU float64: grouped_mm_available is false, the module's own loop runs
    monkeypatch.setattr(gptoss_seam, "grouped_mm_available", lambda *a: True)
    grouped = _out_and_grads(lambda t: local(t, GROUPED_COUNTS), module, x)
    assert calls == [(4, 8, 16), (4, 8, 8)]
    for k in want:
        assert torch.equal(eager[k], want[k]), k
        assert (grouped[k] - want[k]).abs().max().item() <= 1e-12 * want[k].abs().max().item(), k


class PerExpertMuon:
    """DDP's optimizer, plainly: torch.optim.Muon on one nn.Linear weight [out, in] per expert and
    projection (gate = gate_up_proj[e][:, 0::2].T, up = gate_up_proj[e][:, 1::2].T,
    down = down_proj[e].T), copied out of the stacks and back; the other matrices as they are;
    AdamW on the rest (per-expert biases, embeddings and head by the recipe default)."""

    def __init__(self, model: nn.Module) -> None:
        from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, recipe_tail_ids

        tail = recipe_tail_ids(model)
        self.links: list[tuple[nn.Parameter, int, slice, nn.Parameter]] = []
        mats, rest = [], []
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                cols = [slice(0, None, 2), slice(1, None, 2)] if name.endswith("gate_up_proj") else [slice(None)]
                for e in range(p.shape[0]):
                    for c in cols:
                        q = nn.Parameter(p.data[e, :, c].T.clone())
                        self.links.append((p, e, c, q))
                        mats.append(q)
            elif p.ndim == 2 and id(p) not in tail and not name.endswith("_bias"):
                mats.append(p)
            else:
                rest.append(p)
        self.opts = [torch.optim.Muon(mats, **MUON_DEFAULTS), torch.optim.AdamW(rest, **ADAMW_DEFAULTS)]

    def step(self) -> None:
        for p, e, c, q in self.links:
            q.grad = p.grad[e, :, c].T.clone()
        for o in self.opts:
            o.step()
            o.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, e, c, q in self.links:
                p[e, :, c] = q.T
                p.grad = None


def worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, assert_owned_grads_equal, close, compare, full_params, make_sharded_optimizer
    from helpers.models import batch_for, lm_loss
    from helpers.oracle import allreduce_mean_grads
    from lightning_matrixfsdp.runtime.classify import UndeclaredStackWarning

    torch.manual_seed(0)
    sharded = _tiny_gptoss(layers=2, experts=4, hidden=16, inter=12, vocab=VOCAB)
    oracle = copy.deepcopy(sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndeclaredStackWarning)
        mf.matrix_shard(sharded)
    plan = mf.get_plan(sharded)
    opts = make_sharded_optimizer(sharded, "ours")
    ref = PerExpertMuon(oracle)
    for step in range(STEPS):
        idx = batch_for(step, rank)
        lo = lm_loss(oracle(idx).logits, idx)
        ls = lm_loss(sharded(idx).logits, idx)
        assert close(lo.detach(), ls.detach(), EXACT), f"step {step}: loss {ls.item()} vs {lo.item()}"
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle)
        assert_owned_grads_equal(sharded, oracle, EXACT, f"step {step}")
        ref.step()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        compare(full_params(sharded), dict(oracle.named_parameters()), EXACT, "param", step)
    stacks = {s.fqn: s.stack.to_dict() for s in plan.shards() if s.stack is not None}
    return {"stacks": stacks, "plan": str(plan), "checkpoint": _resume(sharded, opts, oracle, rank, root),
            "ep": _expert_parallel(rank, world)}


def _resume(sharded: nn.Module, opts: list, oracle: nn.Module, rank: int, root: str) -> dict[str, Any]:
    """Save (directory and consolidated file), one more step, and a fresh model resumed from the
    directory taking the same step: bitwise the same weights. The file holds GPT-OSS's own keys
    and layout (the whole transposed, interleaved stacks), equal to the oracle's weights."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, compare, full_params, make_sharded_optimizer
    from helpers.models import batch_for, lm_loss

    def step(model: nn.Module, optimizers: list) -> None:
        idx = batch_for(STEPS, rank)
        lm_loss(model(idx).logits, idx).backward()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)

    mf.save_sharded(sharded, f"{root}/gptoss", opts)
    mf.save_sharded(sharded, f"{root}/gptoss.ckpt", opts, full=True)
    out: dict[str, Any] = {}
    if rank == 0:
        saved = torch.load(f"{root}/gptoss.ckpt", weights_only=False)["state_dict"]
        want = dict(oracle.named_parameters())
        out["file_differs"] = sorted(k for k in want if k not in saved or not torch.equal(saved[k], want[k].detach()))
    step(sharded, opts)
    torch.manual_seed(1)  # another init: the load must replace it
    fresh = _tiny_gptoss(layers=2, experts=4, hidden=16, inter=12, vocab=VOCAB)
    mf.matrix_shard(fresh)
    fresh_opts = make_sharded_optimizer(fresh, "ours")
    mf.load_sharded(fresh, f"{root}/gptoss", fresh_opts)
    step(fresh, fresh_opts)
    compare(full_params(fresh), full_params(sharded), EXACT, "resumed", STEPS)
    out["resumed"] = True
    return out


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank: dense ones broadcast from their owner, expert slices
    gathered (the world is one expert-parallel group: rank r holds experts [r E/EP, (r+1) E/EP))."""
    import torch.distributed as dist

    from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, shard_of, state_of

    sg, out = state_of(model).sg, {}
    for name, p in model.named_parameters():
        if expert_slice_of(p) is not None:
            parts = [torch.empty_like(p.data) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.detach().contiguous())
            out[name] = torch.cat(parts)
            continue
        t = p.data.clone() if is_owned(p) else torch.empty(shard_of(p).shape, dtype=p.dtype)
        dist.broadcast(t, src=sg.g(shard_of(p).owner), group=sg.group)
        out[name] = t
    return out


def _expert_parallel(rank: int, world: int) -> dict[str, Any]:
    """expert_parallel_size=2 (float64, as tests/test_moe_ep.py: bf16 Newton-Schulz would amplify a
    float32 difference in summation order) beside one process holding the whole model, fed every
    rank's batch (DDP's loss: the mean), stepped by the per-expert Muon above. The largest
    difference of loss and of any parameter over the steps."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import make_sharded_optimizer
    from helpers.models import batch_for, lm_loss
    from lightning_matrixfsdp.runtime.tags import expert_slice_of, recipe_of

    torch.manual_seed(0)
    # the eager loop (torch's CPU grouped_mm takes no float64)
    model = _tiny_gptoss(layers=1, experts=4, hidden=16, inter=12, vocab=VOCAB,
                         experts_implementation="eager").to(torch.float64)
    oracle = copy.deepcopy(model)
    mf.matrix_shard(model, expert_parallel_size=2)
    # each local slice's shape and the update Muon(model) gives it (the recipe recorded on it)
    local = {n: (tuple(p.shape), "matrix" if recipe_of(p).is_matrix else "adamw")
             for n, p in model.named_parameters() if expert_slice_of(p) is not None}
    opts = make_sharded_optimizer(model, "ours")
    ref = PerExpertMuon(oracle)
    worst = {"loss": 0.0, "param": 0.0}
    for step in range(STEPS):
        idx = batch_for(step, rank)
        loss = lm_loss(model(idx).logits, idx)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        ref_loss = sum(lm_loss(oracle(batch_for(step, r)).logits, batch_for(step, r)) for r in range(world)) / world
        ref_loss.backward()
        ref.step()
        losses = [torch.zeros(1, dtype=loss.dtype) for _ in range(world)]
        torch.distributed.all_gather(losses, loss.detach().reshape(1))
        worst["loss"] = max(worst["loss"], abs(sum(x.item() for x in losses) / world - ref_loss.item()))
        want = dict(oracle.named_parameters())
        worst["param"] = max(worst["param"], max((t - want[n].detach()).abs().max().item()
                                                 for n, t in _whole(model).items()))
    return {"worst": worst, "local": local}


LAUNCH = OneLaunch(worker, 2, tempfile.mkdtemp(prefix="moe_gptoss_"), timeout=600)


def test_tiny_gptoss_at_2_processes_equals_ddp_with_per_expert_muon():
    pytest.importorskip("transformers")
    res = LAUNCH.results()[0]
    assert len(res["stacks"]) == 4, res["stacks"]  # both layers' gate_up_proj and down_proj, declared
    for fqn, d in res["stacks"].items():
        want = ({"num_experts": 4, "blocks": [12, 12], "transposed": True, "interleaved": True}
                if fqn.endswith("gate_up_proj") else {"num_experts": 4, "blocks": [16], "transposed": True})
        assert d == want, (fqn, d)
    assert "each as 2 interleaved blocks (12, 12), stored transposed [E, in, out]" in res["plan"], res["plan"]


def test_tiny_gptoss_checkpoint_resumes_bitwise_and_its_file_holds_the_hugging_face_layout():
    pytest.importorskip("transformers")
    results = LAUNCH.results()
    assert results[0]["checkpoint"]["file_differs"] == [], results[0]["checkpoint"]
    assert all(r["checkpoint"]["resumed"] for r in results)


def test_tiny_gptoss_under_expert_parallelism_equals_one_process():
    """The GPT-OSS seam (runtime/experts/gptoss.py): each rank keeps 2 of the 4 experts of each layer
    (stacks and biases), tokens travel to them; equal to the whole model in one process within
    float64 noise. The local per-expert biases are tail (AdamW), the stacks stacks."""
    pytest.importorskip("transformers")
    for r in LAUNCH.results():
        ep = r["ep"]
        assert ep["worst"]["loss"] < 1e-9 and ep["worst"]["param"] < 1e-9, ep["worst"]
        base = "model.layers.0.mlp.experts."
        assert ep["local"][base + "gate_up_proj"] == ((2, 16, 24), "matrix"), ep["local"]
        assert ep["local"][base + "gate_up_proj_bias"] == ((2, 24), "adamw"), ep["local"]
        assert ep["local"][base + "down_proj_bias"] == ((2, 16), "adamw"), ep["local"]
