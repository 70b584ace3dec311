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
from lightning_matrixfsdp.runtime.experts import ExpertStack, declared_stacks
from lightning_matrixfsdp.runtime.options import MatrixShardError
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
    ours = Muon([stack], **kw)
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
    oa, ob = Muon([a], lr=0.02, batch_shapes=False), Muon([b], lr=0.02, batch_shapes=True)
    for g in _grads(shape, 2, seed=4):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a.data, b.data, rtol=0, atol=2e-3)
    assert not torch.equal(a.data, _stack_and_pieces(shape, blocks, seed=3)[0].data)


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
    ours = cls([stack], **kw)
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
