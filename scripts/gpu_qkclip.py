"""What QK-Clip costs per training step on one GPU (issue 36, section 3): a Llama-style model
trained with ``lightning_matrixfsdp.Muon`` in bf16-mixed precision, with and without
``QKClipper``.

    python scripts/gpu_qkclip.py [--out DIR] [--layers 16 --hidden 2048 --heads 16 --kv-heads 8
        --mlp 5632 --vocab 32000 --seq 2048 --batch 4] [--reps 10] [--tau 100]
        [--causal-rows 256 512 1024] [--attn sdpa]

One process, one device. Measured (median of ``--reps`` rounds after a warm-up round, the
variants interleaved in each round; CUDA events around each piece, the device synchronized after
each):

- ``step_ms``: forward + backward + ``optimizer.step()`` without QK-Clip, and with it (the
  measurement in every forward, ``QKClipper.step()`` after the optimizer), per ``--causal-rows``
  value (query rows per measurement block under the causal mask: masked work, ``rows / T``,
  against kernel launches; ``block_elements`` is raised to let such a block through);
- ``forward_backward_ms``: forward + backward alone, off and measured (the measurement's share);
- ``clip_step_ms``: ``QKClipper.step()`` alone (the factors and the in-place rescale of every
  q/k weight; nothing is reduced in one process);
- ``peak_memory_gib``: the step's peak allocated memory, off and on;
- ``bf16_max_logit_rel_error``: ``head_max_logits`` on random bfloat16 q and k of the model's
  attention shape (logits up to about 100), against the float64 einsum with the causal mask;
- ``bitwise_logits``: the forward's logits with the measurement attached equal those without
  (``torch.equal``; the baseline compared with itself first, to show the forward is deterministic).

On a CPU the times are the process's CPU time on one thread, not the wall clock.

On a CPU pass small sizes (e.g. ``--layers 4 --hidden 512 --heads 8 --kv-heads 4 --mlp 1376
--vocab 2048 --seq 512 --batch 2 --causal-rows 128``); its figures then describe the CPU. Writes
``OUT/gpu_qkclip.json`` (``OUT``: ``--out``, else ``$OUT``, else ``.``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_matrixfsdp as mf  # noqa: E402
from lightning_matrixfsdp.qkclip import logits  # noqa: E402


def time_once(fn, device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on a GPU (the device synchronized after it); on a
    CPU the process's CPU time (all threads), which a busy machine disturbs less than the wall clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b)
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    for name, default in (("layers", 16), ("hidden", 2048), ("heads", 16), ("kv-heads", 8), ("mlp", 5632),
                          ("vocab", 32000), ("seq", 2048), ("batch", 4), ("reps", 10)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--tau", type=float, default=100.0)
    ap.add_argument("--causal-rows", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    return ap.parse_args()


def _model(a: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                      use_cache=False, attn_implementation=a.attn)
    return LlamaForCausalLM(cfg).to(device).train()


def _accuracy(a: argparse.Namespace, device: torch.device) -> float:
    """Largest relative error of the bfloat16 measurement against float64 over every head."""
    g = torch.Generator(device=device).manual_seed(1)
    d = a.hidden // a.heads
    q = (torch.randn(a.batch, a.heads, a.seq, d, device=device, generator=g) * 3).bfloat16()
    k = (torch.randn(a.batch, a.kv_heads, a.seq, d, device=device, generator=g) * 3).bfloat16()
    got = logits.head_max_logits(q, k, d ** -0.5, logits.LogitMask(causal=True))
    kr = k.double().repeat_interleave(a.heads // a.kv_heads, dim=1)
    want = []
    for h in range(a.heads):  # one head at a time: the float64 logits of one head fit anywhere
        s = torch.einsum("btd,bsd->bts", q[:, h].double(), kr[:, h]) * d ** -0.5
        want.append(s.masked_fill(~torch.ones(a.seq, a.seq, dtype=torch.bool, device=device).tril(), float("-inf")).amax())
    want_t = torch.stack(want)
    return float(((got.double() - want_t).abs() / want_t.abs()).max())


def main() -> None:
    a = _args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread: idle OpenMP threads would spin into it
    model = _model(a, device)
    opt = mf.Muon(model.parameters(), lr=0.02, adamw_lr=3e-4)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        with autocast:
            return model(x, labels=x).loss

    def forward_backward() -> None:
        forward().backward()

    def step(clip: "mf.QKClipper | None" = None) -> None:
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if clip is not None:
            clip.step()

    def peak(fn) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0

    out: dict = {"config": vars(a), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "step_ms": {}, "forward_backward_ms": {}, "peak_memory_gib": {}}
    with torch.no_grad(), autocast:  # before any step: the same weights throughout
        base = model(x).logits
        out["bitwise_logits"] = {"baseline_deterministic": bool(torch.equal(base, model(x).logits))}
        with mf.QKClipper(model, tau=a.tau) as clip:
            out["bitwise_logits"]["measured"] = bool(torch.equal(base, model(x).logits))
            out["measured_heads"] = int(torch.isfinite(clip.maxima).sum())
    variants = {"off": None, **{f"clip_rows_{r}": r for r in a.causal_rows}}
    times: dict = {k: {"step": [], "fb": [], "clip": []} for k in variants}

    def attach(rows: int) -> "mf.QKClipper":
        logits.CAUSAL_ROWS[device.type] = rows
        return mf.QKClipper(model, tau=a.tau, block_elements=max(logits.BLOCK_ELEMENTS, rows * a.batch * a.heads * a.seq))

    for rnd in range(a.reps + 1):  # the variants interleaved, round 0 a warm-up: drift hits all alike
        for key, rows in variants.items():
            clip = attach(rows) if rows else None
            t_step = time_once(lambda: step(clip), device)
            t_fb = time_once(forward_backward, device)
            opt.zero_grad(set_to_none=True)
            if clip is not None:
                times[key]["clip"].append(time_once(clip.step, device))
                out["clipped_heads_last_step"] = int(clip.clipped_heads())
                out["largest_logit_last_step"] = float(clip.last_maxima.max())
                clip.remove()
            if rnd:
                times[key]["step"].append(t_step)
                times[key]["fb"].append(t_fb)
    for key, rows in variants.items():
        out["step_ms"][key] = median(times[key]["step"])
        out["forward_backward_ms"][key] = median(times[key]["fb"])
        if rows:
            out.setdefault("clip_step_ms", {})[key] = median(times[key]["clip"])
            with attach(rows) as clip:
                out["peak_memory_gib"][key] = peak(lambda: step(clip))
        else:
            out["peak_memory_gib"][key] = peak(step)
    out["bf16_max_logit_rel_error"] = _accuracy(a, device)
    off = out["step_ms"]["off"]
    out["step_overhead_pct"] = {k: 100 * (v / off - 1) for k, v in out["step_ms"].items() if k != "off"}
    fb = out["forward_backward_ms"]["off"]
    out["forward_backward_overhead_pct"] = {k: 100 * (v / fb - 1) for k, v in out["forward_backward_ms"].items()
                                            if k != "off"}
    path = Path(a.out) / "gpu_qkclip.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
