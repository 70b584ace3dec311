"""QK-Clip (``lightning_matrixfsdp.QKClipper``) in one process against the plain reference of
``tests/helpers/qk_reference.py`` (logits written out with einsum, Kimi K2's rule by hand):

* the measurement leaves outputs and gradients bitwise as they are (eager and sdpa attention,
  Qwen3's q/k norms, the demos' GPT);
* each head's largest logit equals the reference's, for Llama (GQA, with a padding mask),
  Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3's latent attention and the demos' GPT;
* one step rescales exactly the rows the rule says (biases, GQA's shared keys, Qwen3's norms,
  MLA's q_C / q_R / k_C, the fused qkv), over two forwards (the step's maximum);
* bad options and unreadable attention are refused with the cause.

The distributed cases (matrix_fsdp against DDP, tensor parallelism) are in test_qk_clip_dist.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from helpers.qk_reference import SEQ, VOCAB, Capture, build, clip_by_hand, logits_of, step_maxima  # noqa: E402

from lightning_matrixfsdp.qkclip import QKClipError, QKClipper  # noqa: E402


def _batch(seed: int, b: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,kw", [("llama", {"attn_implementation": "eager"}),
                                     ("llama", {"attn_implementation": "sdpa"}),
                                     ("qwen3", {}), ("gpt", {})])
def test_measurement_leaves_outputs_and_gradients_bitwise(name, kw):
    model = build(name, **kw).train()
    x = _batch(1)

    def run() -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        out = logits_of(model, x)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_out, plain_grads = run()
    with QKClipper(model, tau=1e9) as clip:
        out, grads = run()
        assert torch.isfinite(clip.maxima).all()
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    # removed: nothing is measured any more
    before = clip.maxima.clone()
    clip.maxima.fill_(float("-inf"))
    run()
    assert torch.isneginf(clip.maxima).all() and torch.isfinite(before).all()


@pytest.mark.parametrize("name,kw", [("llama", {"attn_implementation": "sdpa"}), ("llama", {"attn_implementation": "eager"}),
                                     ("qwen3", {}), ("mixtral", {}), ("qwen3_moe", {}), ("mla", {}), ("gpt", {})])
def test_head_maxima_equal_the_einsum_reference(name, kw):
    model = build(name, **kw).train()
    cap = Capture(model)
    padded = name == "llama"  # right padding: keys past each row's length are masked
    valid = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        valid[1, SEQ - 5:] = 0
    with QKClipper(model, tau=1e9) as clip:
        logits_of(model, _batch(2), **({"attention_mask": valid} if padded else {}))
        ref = step_maxima(cap, [valid] if padded else None)
    cap.remove()
    want = torch.cat([ref[lay.module] for lay in clip.layouts]).float()
    assert len(clip.layouts) == len(ref)
    torch.testing.assert_close(clip.maxima, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,kw", [("llama", {"attention_bias": True}), ("qwen3", {}), ("mla", {}), ("gpt", {})])
def test_one_step_rescales_as_the_published_rule(name, kw):
    model = build(name, **kw).train()
    cap = Capture(model)
    clip = QKClipper(model, tau=1.0)
    for seed in (3, 4):  # two forwards in the step (accumulation): the maximum over both
        logits_of(model, _batch(seed))
    ref = step_maxima(cap)
    cap.remove()
    every = torch.cat(list(ref.values()))
    tau = every.median().item()  # about half of the heads exceed it
    clip.tau = tau
    expected = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_modules = {id(m): em for m, em in zip(model.modules(), expected.modules())}
    for m, maxima in ref.items():
        clip_by_hand(expected_modules[id(m)], maxima, tau)
    maxima = clip.step()
    clip.remove()
    assert (maxima > tau).any() and (maxima <= tau).any()
    changed = 0
    for (n, p), (_, e) in zip(model.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(p, e, rtol=2e-6, atol=0, msg=lambda m: f"{n}: {m}")
        changed += not torch.equal(p, before[n])
    assert changed >= 2, "nothing was rescaled"


def test_bad_options_and_models_are_refused():
    model = build("llama")
    for tau in (0, -1.0, float("inf"), float("nan"), "100", True):
        with pytest.raises(QKClipError, match="tau must be a positive finite number"):
            QKClipper(model, tau=tau)
    with pytest.raises(QKClipError, match="found no attention layer it knows"):
        QKClipper(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with QKClipper(model, tau=1.0):
        with pytest.raises(QKClipError, match="already watched"):
            QKClipper(model, tau=1.0)


def test_an_unreadable_mask_and_an_unseen_attention_are_refused():
    from lightning_matrixfsdp.qkclip.seams import _WATCHED, hf_logit_mask

    model = build("llama").train()
    attn = model.model.layers[0].self_attn
    q = k = torch.zeros(1, 4, 3, 8)
    with pytest.raises(QKClipError, match="cannot read the mask of attention implementation 'flex_attention'"):
        hf_logit_mask("flex_attention", attn, q, k, object(), {})
    with QKClipper(model, tau=1.0) as clip:
        _WATCHED.pop(attn)  # as if the layer's attention bypassed transformers' AttentionInterface
        logits_of(model, _batch(5))
        with pytest.raises(QKClipError, match="saw the training forward of model.layers.0.self_attn"):
            clip.step()


# ---------------------------------------------------------------------- the measurement kernel alone
def _ref_max(q, k, scale, allowed):
    """Every logit in float64 (einsum), ``allowed`` ``[B, T, S]``, max per head."""
    kr = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("bhtd,bhsd->bhts", q.double(), kr) * scale
    return s.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3)).float()


def test_head_max_logits_in_blocks_equals_every_logit_written_out(monkeypatch):
    from lightning_matrixfsdp.qkclip import logits
    from lightning_matrixfsdp.qkclip.logits import LogitMask, head_max_logits

    g = torch.Generator().manual_seed(0)
    b, h, kv, t, d = 2, 4, 2, 11, 8
    q, k = torch.randn(b, h, t, d, generator=g), torch.randn(b, kv, t, d, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    pad = torch.ones(b, t, dtype=torch.bool)
    pad[1, 7:] = False
    seg = torch.tensor([[0] * 4 + [1] * 5 + [2] * 2])
    qi, kj = torch.arange(t)[:, None], torch.arange(t)[None]
    cases = {
        "causal": (LogitMask(causal=True), causal),
        "bool mask": (LogitMask((causal & pad[:, None, :])[:, None]), causal & pad[:, None, :]),
        "float mask": (LogitMask(torch.zeros(b, 1, t, t).masked_fill(~(causal & pad[:, None, :])[:, None], -3e38) > -1e38),
                       causal & pad[:, None, :]),
        "window 3": (LogitMask(causal=True, window=3), causal & (qi - kj < 3)),
        "segments": (LogitMask(causal=True, segments=seg.expand(b, t)), causal & (seg[0][:, None] == seg[0][None])),
        "no mask": (LogitMask(), torch.ones(b, t, t, dtype=torch.bool)),
    }
    for rows in (3, 4, 64):  # uneven blocks, one block
        monkeypatch.setitem(logits.CAUSAL_ROWS, "cpu", rows)
        for name, (mask, allowed) in cases.items():
            got = head_max_logits(q, k, 0.3, mask, block_elements=rows * b * h * t)
            torch.testing.assert_close(got, _ref_max(q, k, 0.3, allowed), rtol=1e-5, atol=1e-6, msg=f"{name}, {rows} rows")
    # a cache before the queries (S > T): query i sees keys up to i + S - T
    kc = torch.randn(b, kv, t + 5, d, generator=g)
    allowed = torch.ones(t, t + 5, dtype=torch.bool).tril(5).expand(b, t, t + 5)
    torch.testing.assert_close(head_max_logits(q, kc, 0.3, LogitMask(causal=True), block_elements=64),
                               _ref_max(q, kc, 0.3, allowed), rtol=1e-5, atol=1e-6)


def test_flash_style_arguments_give_the_mask_transformers_applies():
    from lightning_matrixfsdp.qkclip.seams import hf_logit_mask

    attn = build("llama").model.layers[0].self_attn
    b, t = 1, 8
    q = k = torch.zeros(b, 4, t, 8)
    qi, kj = torch.arange(t)[:, None], torch.arange(t)[None]
    causal = kj <= qi

    def allowed(mask) -> torch.Tensor:  # what head_max_logits would keep, as [B, T, S]
        from lightning_matrixfsdp.qkclip.logits import _pair_mask

        out = _pair_mask(mask, 0, t, 0, t, 0, q.device)
        return out.reshape(-1, t, t).expand(b, t, t) if out is not None else torch.ones(b, t, t, dtype=torch.bool)

    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    same = (packed == 0).cumsum(-1)
    same = same[0][:, None] == same[0][None]
    assert torch.equal(allowed(hf_logit_mask("flash_attention_2", attn, q, k, None, {"position_ids": packed})),
                       (causal & same).expand(b, t, t))
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    assert torch.equal(allowed(hf_logit_mask("flash_attention_2", attn, q, k, None, {"cu_seq_lens_k": cu})),
                       (causal & same).expand(b, t, t))
    assert torch.equal(allowed(hf_logit_mask("flash_attention_2", attn, q, k, None, {"sliding_window": 3})),
                       (causal & (qi - kj < 3)).expand(b, t, t))
    assert torch.equal(allowed(hf_logit_mask("sdpa", attn, q, k, None, {"sliding_window": 3})), causal.expand(b, t, t))
    pad = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    want = causal & pad.bool()[0][None] & pad.bool()[0][:, None]
    assert torch.equal(allowed(hf_logit_mask("flash_attention_2", attn, q, k, pad, {})), want.expand(b, t, t))


def test_fsdp1_flat_parameters_are_refused(monkeypatch):
    import torch.distributed.fsdp as fsdp

    class Flat(torch.nn.Module):  # stands for an FSDP1 wrapper (no process group needed here)
        pass

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", Flat)
    model = build("llama")
    model.add_module("wrapper", Flat())
    with pytest.raises(QKClipError, match="flat parameters of FullyShardedDataParallel"):
        QKClipper(model, tau=1.0)


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = build("llama")
    with pytest.raises(QKClipError, match="still on the meta device"):
        QKClipper(model, tau=1.0)


def test_heads_a_rank_cannot_place_are_refused():
    from lightning_matrixfsdp.qkclip.logits import LogitMask

    model = build("llama").train()
    with QKClipper(model, tau=1.0) as clip:  # not parallelized: every rank computes all 4 heads
        q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8)
        with pytest.raises(QKClipError, match="computed 2 of its 4 query heads"):
            clip._recorder(0)(q, k, LogitMask(), None)
