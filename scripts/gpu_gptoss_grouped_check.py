"""GPT-OSS's local experts under expert parallelism: the grouped GEMMs beside the module's own loop.

    python scripts/gpu_gptoss_grouped_check.py [--out FILE] [--reps N]    # one CUDA GPU, bf16
    python scripts/gpu_gptoss_grouped_check.py --cpu                      # tiny, float32, to check the script

Builds one Hugging Face ``GptOssExperts`` (8 experts, hidden 512, intermediate 512, bf16 on
CUDA) and 4096 expert-major rows with uneven counts (expert 1 gets none), the rows one rank
computes under EP. On the same rows and the same output gradient it runs

- ``eager``: the module's own per-expert loop (what the seam ran before, and still runs off CUDA);
- ``grouped``: ``gptoss_seam.gptoss_experts_forward`` with ``torch.nn.functional.grouped_mm``
  (with ``--cpu``: the per-expert matmul standing in for it, and ``F.grouped_mm`` too where the
  CPU runs it);
- ``fp32``: the module's loop on a float32 copy, the reference both are measured against;

and writes (``--out``, default ``$OUT/gptoss_grouped.json``) for the output and every gradient
(input, ``gate_up_proj``, ``gate_up_proj_bias``, ``down_proj``, ``down_proj_bias``) the largest
absolute and relative (over the largest entry of eager's) difference of grouped from eager,
whether they are bitwise equal, each one's relative error from fp32, whether the empty expert's
gradients are exact zeros (``no_rows_ok``: every gradient zero and the output empty for a call
with no row at all), whether the seam's own local computation took the grouped path (and which
paths' outputs it equals bitwise), and the median milliseconds of forward plus backward of each
(CUDA events, ``--reps``). One process, one device, nothing distributed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_matrixfsdp.bench.timing import median_ms  # noqa: E402
from lightning_matrixfsdp.runtime.experts import gptoss as gptoss_seam  # noqa: E402
from lightning_matrixfsdp.runtime.experts.dispatch import grouped_mm_available  # noqa: E402

PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
GPU_COUNTS = [1024, 0, 96, 768, 1536, 8, 408, 256]  # 4096 rows, expert 1 none, multiples of 8 or not
CPU_COUNTS = [5, 0, 9, 2]


def build(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A GptOssExperts with weights scaled so that some gate/up values pass the clamp (limit 7)."""
    import transformers as T
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = T.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, head_dim=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    m = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 3 / hidden ** 0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) / inter ** 0.5)
        m.gate_up_proj_bias.copy_(torch.randn(m.gate_up_proj_bias.shape, generator=g) * 0.5)
        m.down_proj_bias.copy_(torch.randn(m.down_proj_bias.shape, generator=g) * 0.5)
    return m.to(device=device, dtype=dtype)


def eager(module: torch.nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The module's own loop (under transformers' implementation switch), each row once, weight 1."""
    own = type(module).forward
    own = getattr(own, "__wrapped__", own)
    ids = torch.repeat_interleave(torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device))
    return own(module, x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device))


def grouped(mm: Callable) -> Callable[[torch.nn.Module, torch.Tensor, list[int]], torch.Tensor]:
    def run(module: torch.nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return gptoss_seam.gptoss_experts_forward(x, counts, *(getattr(module, n) for n in PARAMS),
                                                  module.alpha, module.limit, mm=mm)
    return run


def out_and_grads(fn: Callable, module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(module, x)
    out.backward(g.to(out.dtype))
    return {"out": out.detach(), "x": x.grad, **{n: getattr(module, n).grad.clone() for n in PARAMS}}


def compare(got: dict, want: dict, ref: dict, empty: int) -> dict:
    res = {}
    for k, w in want.items():
        a, w32 = got[k].float(), w.float()
        scale = max(w32.abs().max().item(), 1e-30)
        r32 = ref[k].float()
        r32_scale = max(r32.abs().max().item(), 1e-30)
        res[k] = {"max_abs": (a - w32).abs().max().item(), "max_rel": (a - w32).abs().max().item() / scale,
                  "bitwise": bool(torch.equal(got[k], w)),
                  "rel_err_vs_fp32": (a - r32).abs().max().item() / r32_scale,
                  "eager_rel_err_vs_fp32": (w32 - r32).abs().max().item() / r32_scale}
    res["empty_expert_grads_zero"] = all(bool((got[n][empty] == 0).all()) for n in PARAMS)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes in float32 on the CPU (checks the script)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gptoss_grouped.json"))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.cpu:
        device, dtype, counts, hidden, inter = torch.device("cpu"), torch.float32, CPU_COUNTS, 16, 16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --cpu to check the script here")
        device, dtype, counts, hidden, inter = torch.device("cuda"), torch.bfloat16, GPU_COUNTS, 512, 512
    empty = counts.index(0)
    module = build(len(counts), hidden, inter, dtype, device)
    ref_module = copy.deepcopy(module).float()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(sum(counts), hidden, generator=gen, device=device).to(dtype)
    g = torch.randn(sum(counts), hidden, generator=gen, device=device).to(dtype)
    params = [getattr(module, n) for n in PARAMS]

    if args.cpu:
        paths = {"per_expert_mm": grouped(gptoss_seam.per_expert_mm)}
    else:
        paths = {"grouped": grouped(F.grouped_mm)}
    if args.cpu:
        try:
            out_and_grads(lambda m, t: grouped(F.grouped_mm)(m, t, counts), copy.deepcopy(module), x, g)
            paths["grouped"] = grouped(F.grouped_mm)
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            print(f"F.grouped_mm does not run on this CPU: {e}")
    want = out_and_grads(lambda m, t: eager(m, t, counts), module, x, g)
    ref = out_and_grads(lambda m, t: eager(m, t, counts), ref_module, x.float(), g.float())
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype), "counts": counts, "hidden": hidden,
                 "intermediate": inter, "grouped_mm_available": grouped_mm_available(x, *params),
                 "clamp_active_fraction": None, "compare": {}, "ms_fwd_bwd": {}}
    with torch.no_grad():
        ids = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
        ends = torch.tensor(counts).cumsum(0).tolist()
        pre = torch.cat([x[a:b].float() @ ref_module.gate_up_proj[e] for e, (a, b) in
                         enumerate(zip([0] + ends[:-1], ends))]) + ref_module.gate_up_proj_bias[ids]
        res["clamp_active_fraction"] = ((pre[:, ::2] > module.limit).float().mean().item(),
                                        (pre[:, 1::2].abs() > module.limit).float().mean().item())
    outs = {"eager": want["out"]}
    for name, fn in paths.items():
        got = out_and_grads(lambda m, t: fn(m, t, counts), module, x, g)
        res["compare"][name] = compare(got, want, ref, empty)
        outs[name] = got["out"]
        # a rank that receives no row: an empty output and every gradient exact zeros
        none = out_and_grads(lambda m, t: fn(m, t, [0] * len(counts)), module, x[:0], g[:0])
        res["compare"][name]["no_rows_ok"] = (tuple(none["out"].shape) == (0, hidden)
                                              and all(not none[k].any() for k in none))

    # which path the seam's own local computation takes (counting F.grouped_mm's calls)
    calls = []
    real = getattr(F, "grouped_mm", None)

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    local = gptoss_seam.install_gptoss_forward(copy.deepcopy(module), len(counts), lambda *a: None, None)
    F.grouped_mm = counting
    try:
        seam_out = local(x, counts)
    finally:
        F.grouped_mm = real
    res["seam_took_grouped"] = len(calls) == 2
    res["seam_output_bitwise_equals"] = [k for k, v in outs.items() if torch.equal(seam_out, v)]

    timed = {"eager": lambda m, t: eager(m, t, counts)}
    timed.update({n: (lambda f: lambda m, t: f(m, t, counts))(f) for n, f in paths.items()})
    for name, fn in timed.items():
        res["ms_fwd_bwd"][name] = median_ms(lambda: out_and_grads(fn, module, x, g), device, reps=args.reps,
                                            warmup=3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
