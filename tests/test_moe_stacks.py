"""Expert stacks: stepped as E independent matrices, declared (never guessed), classified with a reason.

Oracles: ``torch.optim.Muon`` on E (or 2E for a fused gate/up) separate 2-D parameters, and
the Shampoo/SOAP wrappers on separate 2-D parameters (themselves checked against the library in
test_optim_shampoo_soap.py). One process, float32; every comparison is bitwise.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack, declared_stacks
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import stack_of, tag_stack

E, I, H = 3, 5, 8  # experts, rows of one gate (or up) block, columns: tall and wide blocks, unequal shapes


def _grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _stack_and_pieces(shape: tuple[int, ...], blocks: tuple[int, ...], seed: int):
    """A tagged stack and, written plainly, the separate 2-D copies of its (expert, block) matrices."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    stack = nn.Parameter(w.clone())
    tag_stack(stack, ExpertStack(shape[0], blocks))
    cuts = [sum(blocks[:j]) for j in range(len(blocks) + 1)]
    pieces = [[nn.Parameter(w[e, cuts[j]:cuts[j + 1]].clone()) for j in range(len(blocks))] for e in range(shape[0])]
    return stack, pieces, cuts


MUON_CASES = {
    "plain": ((E, H, 2 * I), (H,), dict(lr=0.02)),                          # down_proj [E, H, I']: wide
    "gate_up": ((E, 2 * I, H), (I, I), dict(lr=0.02)),                       # fused gate_up [E, 2I, H]
    "gate_up_rms": ((E, 2 * I, H), (I, I), dict(lr=0.02, adjust_lr_fn="match_rms_adamw")),
    "tall_no_nesterov": ((E, 3 * H, I), (H, 2 * H), dict(lr=0.01, nesterov=False, weight_decay=0.0)),
}


@pytest.mark.parametrize("case", sorted(MUON_CASES))
def test_muon_stack_equals_torch_muon_on_separate_matrices(case):
    shape, blocks, kw = MUON_CASES[case]
    stack, pieces, cuts = _stack_and_pieces(shape, blocks, seed=1)
    ours = Muon([{"params": [stack], "role": "matrix"}], **kw)  # a stack is a matrix only in a group that says so
    flat = [p for row in pieces for p in row]
    ref = torch.optim.Muon(flat, **kw)
    for g in _grads(shape, 3, seed=2):
        stack.grad = g.clone()
        for e, row in enumerate(pieces):
            for j, p in enumerate(row):
                p.grad = g[e, cuts[j]:cuts[j + 1]].clone()
        ours.step()
        ref.step()
        buf = ours.state[stack]["momentum_buffer"]
        for e, row in enumerate(pieces):
            for j, p in enumerate(row):
                assert torch.equal(stack.data[e, cuts[j]:cuts[j + 1]], p.data), (case, e, j)
                assert torch.equal(buf[e, cuts[j]:cuts[j + 1]], ref.state[p]["momentum_buffer"]), (case, e, j)


def test_muon_stack_batched_over_experts_equals_per_matrix():
    """``batch_shapes=True`` orthogonalizes the E matrices of one block shape as one batch: the
    result equals the per-matrix path within bf16 rounding on CPU (bitwise on an H200, where it is
    the default: docs/moe.md)."""
    shape, blocks = (4, 2 * I, H), (I, I)
    a, _, _ = _stack_and_pieces(shape, blocks, seed=3)
    b, _, _ = _stack_and_pieces(shape, blocks, seed=3)
    oa = Muon([{"params": [a], "role": "matrix"}], lr=0.02, batch_shapes=False)
    ob = Muon([{"params": [b], "role": "matrix"}], lr=0.02, batch_shapes=True)
    for g in _grads(shape, 2, seed=4):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a.data, b.data, rtol=0, atol=2e-3)
    assert not torch.equal(a.data, _stack_and_pieces(shape, blocks, seed=3)[0].data)


def test_muon_whole_stack_batched_with_symmetric_blocks_matches_torch_muon(monkeypatch):
    """A stack of one block shape with batching goes through the whole-stack path (its pieces viewed
    in place, one batched iteration, here with symmetric blocks; the default on CUDA): torch.optim.Muon
    on the separate matrices, to bf16 rounding of the update (bitwise on the H200:
    docs/benchmarks.md), and the momentum exactly."""
    from lightning_matrixfsdp.optim import muon as muon_module

    calls = []
    real = muon_module.orthogonalize_stack
    monkeypatch.setattr(muon_module, "orthogonalize_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    shape, blocks = (1, 2 * 768, 512), (768, 768)  # tall (768, 512) pieces: 2 blocks of 256 rows fit
    stack, pieces, cuts = _stack_and_pieces(shape, blocks, seed=5)
    ours = Muon([{"params": [stack], "role": "matrix"}], lr=0.02, batch_shapes=True, symmetric_blocks=2)
    flat = [p for row in pieces for p in row]
    ref = torch.optim.Muon(flat, lr=0.02)
    for g in _grads(shape, 1, seed=6):  # one step: the batched bf16 products are slow on CPU
        stack.grad = g.clone()
        for e, row in enumerate(pieces):
            for j, p in enumerate(row):
                p.grad = g[e, cuts[j]:cuts[j + 1]].clone()
        ours.step()
        ref.step()
    assert len(calls) == 1  # one batch of the 2 pieces
    buf = ours.state[stack]["momentum_buffer"]
    for e, row in enumerate(pieces):
        for j, p in enumerate(row):
            torch.testing.assert_close(stack.data[e, cuts[j]:cuts[j + 1]], p.data, rtol=0, atol=1e-4)
            assert torch.equal(buf[e, cuts[j]:cuts[j + 1]], ref.state[p]["momentum_buffer"])


def test_untagged_3d_parameter_is_not_a_stack():
    p = nn.Parameter(torch.randn(2, 3, 4))
    assert stack_of(p) is None
    with pytest.raises(ValueError):
        tag_stack(p, ExpertStack(2, (0,)))
    tag_stack(p, ExpertStack(2, (3,)))
    assert stack_of(p) == ExpertStack(2, (3,))


# ---------------------------------------------------------------------- Shampoo / SOAP
LIB_CASES = {
    "soap": ("SOAP", dict(lr=0.01, precondition_frequency=2)),
    "shampoo": ("Shampoo", dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                block_size=4, graft_type="rmsprop", use_svd=True)),
}


@pytest.mark.parametrize("case", sorted(LIB_CASES))
def test_library_stack_equals_per_expert_instances(case):
    pytest.importorskip("pytorch_optimizer")
    from lightning_matrixfsdp.optim import matrix_optimizers

    name, kw = LIB_CASES[case]
    cls = getattr(matrix_optimizers, name)
    shape, blocks = (E, 2 * I, H), (I, I)
    stack, pieces, cuts = _stack_and_pieces(shape, blocks, seed=5)
    ours = cls([{"params": [stack], "role": "matrix"}], **kw)
    refs = [[cls([p], **kw) for p in row] for row in pieces]  # one instance per matrix
    for g in _grads(shape, 3, seed=6):
        stack.grad = g.clone()
        for e, row in enumerate(pieces):
            for j, p in enumerate(row):
                p.grad = g[e, cuts[j]:cuts[j + 1]].clone()
                refs[e][j].step()
        ours.step()
    state = ours.state[stack]
    for e, row in enumerate(pieces):
        for j, p in enumerate(row):
            assert torch.equal(stack.data[e, cuts[j]:cuts[j + 1]], p.data), (case, e, j)
            ref_state = refs[e][j].state[p]
            for key, value in ref_state.items():
                mine = state[f"block{j}/{key}"] if len(blocks) > 1 else state[key]
                if isinstance(value, torch.Tensor):
                    assert mine.shape[0] == E, key  # per expert: a leading E dimension
                    assert torch.equal(mine[e], value), (case, key, e, j)


# ---------------------------------------------------------------------- classification
class OwnMoE(nn.Module):
    """A user's own MoE block: a fused w13 stack [E, 2F, D], a plain w2 stack [E, D, F]; an
    embedding, a head to the vocabulary, and a 1-D scale."""

    def __init__(self, experts: int = 4, d: int = 8, f: int = 6, vocab: int = 20) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.w13 = nn.Parameter(torch.randn(experts, 2 * f, d))
        self.w2 = nn.Parameter(torch.randn(experts, d, f))
        self.router = nn.Linear(d, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, vocab, bias=False)


def _collect(model: nn.Module, **options):
    from lightning_matrixfsdp.runtime.shard import collect

    return collect(model, MatrixFSDPConfig(**options))


def _roles(collected) -> dict[str, tuple[bool, object]]:
    return {p.fqn: (p.is_matrix, p.stack) for u in collected.specs for p in u.params}


def test_undeclared_3d_parameter_warns_naming_it_and_goes_to_adamw():
    from lightning_matrixfsdp.runtime.classify import UndeclaredStackWarning

    with pytest.warns(UndeclaredStackWarning, match=r"w13 \(4, 12, 8\).*w2 \(4, 8, 6\)"):
        roles = _roles(_collect(OwnMoE()))
    assert roles["w13"] == (False, None) and roles["w2"] == (False, None)
    with warnings.catch_warnings():  # declared: no warning, matrix roles with their stacks
        warnings.simplefilter("error", UndeclaredStackWarning)
        roles = _roles(_collect(OwnMoE(), expert_stacks={"w13": 2, "w2": None}))
    assert roles["w13"] == (True, ExpertStack(4, (6, 6))) and roles["w2"] == (True, ExpertStack(4, (8,)))


def test_flatten_conv_on_a_declared_stack_is_refused():
    with pytest.raises(MatrixShardError, match=r"flatten_conv=True would orthogonalize the expert stack 'w13'"):
        _collect(OwnMoE(), expert_stacks={"w13": 2, "w2": None}, flatten_conv=True)
    hf = pytest.importorskip("transformers")
    model = hf.MixtralForCausalLM(hf.MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=6,
                                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                   num_local_experts=2))
    with pytest.raises(MatrixShardError, match=r"expert stack 'model\.layers\.0\.mlp\.experts\.down_proj'"):
        _collect(model, flatten_conv=True)  # an automatic declaration is refused the same way


def test_expert_stacks_option_is_checked():
    for bad, why in ((3, "is not accepted"), ({"w13": 0}, "blocks of pattern 'w13'"), ({"": 2}, "pattern ''"),
                     ({"w13": [2, "x"]}, "blocks of pattern")):
        with pytest.raises(MatrixShardError, match=why):
            MatrixFSDPConfig(expert_stacks=bad)
    with pytest.raises(MatrixShardError, match="matches no parameter"):
        _collect(OwnMoE(), expert_stacks=["nothing.*"])
    with pytest.raises(MatrixShardError, match=r"has shape \(8,\)"):
        _collect(OwnMoE(), expert_stacks=["scale"])
    with pytest.raises(MatrixShardError, match="do not divide"):
        _collect(OwnMoE(), expert_stacks={"w2": 3})
    assert MatrixFSDPConfig(expert_stacks="w*").expert_stacks == (("w*", None),)
    call = _collect(OwnMoE(), expert_stacks=lambda fqn, p: p.ndim == 3)  # a callable: True is a plain stack
    assert _roles(call)["w13"] == (True, ExpertStack(4, (12,)))


def test_recipe_roles_and_placement_roles_and_matrix_filter_wins():
    """The Muon recipe (recipe_roles: what Muon(model) steps how) keeps embeddings and the head on
    AdamW; the placement (classify) makes every 2-D parameter a matrix role, so the optimizer the
    user builds decides, as under DDP; an explicit matrix_filter decides the placement."""
    from lightning_matrixfsdp.runtime.classify import recipe_roles

    model = OwnMoE()
    recipe = {k: (c.is_matrix, c.stack) for k, c in recipe_roles(model, expert_stacks=["w*"]).items()}
    assert recipe["tok.weight"] == (False, None)  # nn.Embedding
    assert recipe["head.weight"] == (False, None)  # the last nn.Linear projecting to the vocabulary
    assert recipe["router.weight"] == (True, None)
    assert recipe["scale"] == (False, None)
    assert recipe["w13"][0] and recipe["w13"][1] is not None
    reasons = recipe_roles(model, expert_stacks=["w*"])
    assert "nn.Embedding weight" in reasons["tok.weight"].reason
    assert "output head" in reasons["head.weight"].reason
    placed = _roles(_collect(model, expert_stacks=["w*"]))
    assert placed["tok.weight"] == (True, None) and placed["head.weight"] == (True, None)  # no recipe in placement
    assert placed["scale"] == (False, None)
    # an explicit matrix_filter decides the placement, for embeddings, head and stacks alike
    chosen = _roles(_collect(model, expert_stacks=["w*"], matrix_filter=lambda fqn, p: fqn != "w2"))
    assert chosen["tok.weight"] == (True, None) and chosen["head.weight"] == (True, None)
    assert chosen["w2"] == (False, None) and chosen["w13"][0]
    # a head tied to the embedding is that embedding: AdamW in the recipe
    model.head.weight = model.tok.weight
    assert not recipe_roles(model, expert_stacks=["w*"])["tok.weight"].is_matrix
    hf = pytest.importorskip("transformers")
    llama = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1))
    recipe = recipe_roles(llama)
    assert not recipe["model.embed_tokens.weight"].is_matrix and not recipe["lm_head.weight"].is_matrix
    assert recipe["model.layers.0.mlp.down_proj.weight"].is_matrix


def test_stack_flops_are_counted_per_expert_and_block():
    from lightning_matrixfsdp.runtime.roles import newton_schulz_flops

    stack = ExpertStack(4, (6, 6))
    per_block = newton_schulz_flops((6, 8))
    assert newton_schulz_flops((4, 12, 8), 5, stack) == 4 * 2 * per_block
    assert newton_schulz_flops((4, 12, 8), 5, stack) != newton_schulz_flops((4, 12, 8))  # not the flattened matrix
    from lightning_matrixfsdp.runtime.placement import ParamSpec, RoleKind
    from lightning_matrixfsdp.runtime.roles import role_cost

    spec = ParamSpec("w13", (4, 12, 8), "float32", True, True, stack)
    assert role_cost(RoleKind.MATRIX, [spec])[1] == 4 * 2 * per_block  # the planner's price of the role


def test_muon_of_the_module_steps_stacks_per_expert_outside_matrix_shard_and_the_untagged_warning():
    """Plain DDP / one device: 3-D experts in bare parameters go to AdamW (warned), as under
    matrix_fsdp; Muon built from the module steps each expert (gate and up apart) as
    torch.optim.Muon does on separate matrices."""
    hf = pytest.importorskip("transformers")
    cfg = hf.MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=3)
    torch.manual_seed(0)
    experts = hf.MixtralForCausalLM(cfg).model.layers[0].mlp.experts
    grads = {n: torch.randn_like(p) for n, p in experts.named_parameters()}
    for n, p in experts.named_parameters():
        p.grad = grads[n].clone()
    with pytest.warns(UserWarning, match=r"steps a parameter of size \(3, 12, 8\) with AdamW"):
        Muon(experts.parameters(), lr=0.02).step()
    stacks = {"gate_up_proj": ExpertStack(3, (6, 6)), "down_proj": ExpertStack(3, (8,))}
    ours = Muon(experts, lr=0.02)
    assert [g["role"] for g in ours.param_groups] == ["matrix"]
    w = {n: p.detach().clone() for n, p in experts.named_parameters()}
    separate = {(n, e, a): nn.Parameter(w[n][e, a:a + s.blocks[0]].clone())
                for n, s in stacks.items() for e in range(3) for a in range(0, s.rows, s.blocks[0])}
    ref = torch.optim.Muon(list(separate.values()), lr=0.02)
    for (n, e, a), q in separate.items():
        q.grad = grads[n][e, a:a + q.shape[0]].clone()
    for n, p in experts.named_parameters():
        p.grad = grads[n].clone()
    ours.step()
    ref.step()
    for (n, e, a), q in separate.items():
        assert torch.equal(dict(experts.named_parameters())[n].data[e, a:a + q.shape[0]], q.data), (n, e, a)
