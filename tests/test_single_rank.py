"""A shard group of one rank: nothing to shard, nothing paid (issue 22, item 6).

With one rank, the unsharded parameters share the resident weights' storage: a forward
copies nothing, a reshard frees nothing, the gradient is not divided by 1; results stay
equal to the plainly written optimizer (tests/helpers/oracle.py) bit for bit.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import lightning_matrixfsdp as mf
from helpers.models import TinyLM
from helpers.equiv import make_sharded_optimizer
from helpers.oracle import oracle_optimizers

STEPS = 3


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (4, 16), generator=g)


def _loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _linear_weights_seen_in_forward(model: torch.nn.Module) -> dict[str, int]:
    """name -> data pointer of each Linear weight as the forward sees it (the unsharded one)."""
    seen: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, a, n=name: seen.__setitem__(n, m.weight.data_ptr()))
    return seen


def _oracle_and_one_rank_model() -> tuple[TinyLM, TinyLM, dict[str, torch.nn.Parameter], dict[str, int]]:
    """A plain TinyLM (the oracle's model), its copy sharded over one rank, the copy's resident
    parameters (taken before sharding) and the Linear weights its forward sees."""
    torch.manual_seed(0)
    oracle = TinyLM()
    model = copy.deepcopy(oracle)
    residents = {n: p for n, p in model.named_parameters()}
    mf.matrix_shard(model)
    return oracle, model, residents, _linear_weights_seen_in_forward(model)


def test_one_rank_forward_uses_the_resident_storage_and_equals_the_oracle():
    oracle, model, residents, seen = _oracle_and_one_rank_model()
    opts = make_sharded_optimizer(model, "ours")
    ref = oracle_optimizers(oracle)
    for step in range(STEPS):
        idx = _batch(step)
        loss = _loss(model, idx)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        ref_loss = _loss(oracle, idx)
        ref_loss.backward()
        for o in ref:
            o.step()
            o.zero_grad()
        assert torch.equal(loss.detach(), ref_loss.detach()), step
    # zero copy: every Linear ran on the very bytes of its resident weight
    assert seen and all(ptr == residents[f"{n}.weight"].data_ptr() for n, ptr in seen.items()), seen
    for (n, p), (_, q) in zip(model.named_parameters(), oracle.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_one_rank_follows_a_replaced_resident_and_refuses_a_changed_dtype():
    oracle, model, residents, seen = _oracle_and_one_rank_model()
    idx = _batch(0)
    with torch.no_grad():
        for (n, q) in oracle.named_parameters():
            new = torch.randn_like(q)
            residents[n].data = new  # replaced, not written in place: the alias must follow
            q.copy_(new)
    out, ref = model(idx), oracle(idx)
    assert torch.equal(out, ref)
    assert seen["head"] == residents["head.weight"].data_ptr()
    out.sum().backward()  # end the iteration: every unit back to its resident
    residents["head.weight"].data = residents["head.weight"].data.double()
    with pytest.raises(RuntimeError, match="'head.weight' changed to .*float64.*after matrix_shard"):
        model(idx)


def test_one_rank_with_param_dtype_still_casts():
    """With something to cast (param_dtype), the forward runs on a bf16 copy, as before."""
    torch.manual_seed(0)
    model = TinyLM()
    residents = {n: p for n, p in model.named_parameters()}
    mf.matrix_shard(model, param_dtype=torch.bfloat16)
    seen = _linear_weights_seen_in_forward(model)
    model(_batch(0))
    assert all(ptr != residents[f"{n}.weight"].data_ptr() for n, ptr in seen.items())


def test_one_rank_clipping_is_torchs():
    """One rank holds every gradient: ``clip_grad_norm_`` is torch's own (its fused kernels
    too), the same total and gradients bit for bit."""
    oracle, model, _, _ = _oracle_and_one_rank_model()
    idx = _batch(0)
    _loss(model, idx).backward()
    _loss(oracle, idx).backward()
    ours = mf.clip_grad_norm_(model, 0.05)
    theirs = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05)
    assert torch.equal(ours, theirs) and ours > 0.05  # the clip really scaled
    for (n, p), (_, q) in zip(model.named_parameters(), oracle.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
