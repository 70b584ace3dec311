"""Lifecycle properties that need no second process (shard span 1)."""
import copy
import gc
import weakref

import torch

import lightning_matrixfsdp as mf
from helpers.equiv import check_memory_shape
from helpers.models import TinyLM, batch_for, lm_loss


def test_a_dropped_model_is_freed():
    m = mf.matrix_shard(TinyLM(checkpointing=True))
    opt = mf.route_optimizer(mf.Muon(m.parameters()))
    for s in range(2):
        idx = batch_for(s, 0)
        lm_loss(m(idx), idx).backward()
        opt.step()
        opt.zero_grad()
    ref = weakref.ref(m)
    del m, opt
    gc.collect()
    assert ref() is None, "hooks keep the sharded model alive"


def test_forward_without_backward_then_training_continues_exactly():
    torch.manual_seed(0)
    ref_model = TinyLM()
    m = mf.matrix_shard(copy.deepcopy(ref_model))
    idx = batch_for(0, 0)
    m(idx)  # grad-enabled forward whose graph is dropped
    with torch.no_grad():
        m(idx)
    loss = lm_loss(m(idx), idx)
    loss.backward()
    expect = lm_loss(ref_model(idx), idx)
    expect.backward()
    assert torch.equal(loss, expect)
    grads = {n: p.grad for n, p in m.named_parameters()}
    for n, p in ref_model.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    check_memory_shape(m)


def test_eval_forward_leaves_no_buffers_and_matches():
    torch.manual_seed(0)
    ref_model = TinyLM(checkpointing=True)
    m = mf.matrix_shard(copy.deepcopy(ref_model))
    idx = batch_for(3, 0)
    with torch.no_grad():
        out = m(idx)
    assert torch.equal(out, ref_model(idx).detach())
    check_memory_shape(m)
