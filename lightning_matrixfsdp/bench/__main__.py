"""`python -m lightning_matrixfsdp.bench`: the side-by-side benchmark.

    torchrun --nproc-per-node 2 -m lightning_matrixfsdp.bench --preset onenode
    python -m lightning_matrixfsdp.bench --preset tiny --nproc 2      # CPU, gloo
    python -m lightning_matrixfsdp.bench predict --help               # the step-time predictor

A preset fixes every default; the flags below override single fields.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .config import ALL_MODES, MODE_ALIASES, PRESETS, BenchConfig, expand_modes, preset


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"modes or aliases ({', '.join(MODE_ALIASES)}); known: {', '.join(ALL_MODES)}")
    p.add_argument("--nproc", type=int, default=None, help="spawn N local workers (when not under torchrun)")
    run = p.add_argument_group("run")
    run.add_argument("--warmup", type=int)
    run.add_argument("--steps", type=int)
    run.add_argument("--batch-size", type=int)
    run.add_argument("--dtype", choices=["float32", "bfloat16"])
    run.add_argument("--device", choices=["auto", "cpu", "cuda"])
    run.add_argument("--seed", type=int)
    run.add_argument("--planner", help="matrix_fsdp planner (role_greedy, scope_greedy, cost_aware)")
    run.add_argument("--zero1-assignment", choices=["greedy", "round_robin"])
    run.add_argument("--timeout", type=float, dest="collective_timeout_s", help="per-mode collective timeout, seconds")
    run.add_argument("--out", dest="out_dir", help="output directory for JSON/markdown/PNG")
    run.add_argument("--no-count-bytes", dest="count_bytes", action="store_false", default=None)
    run.add_argument("--no-plot", dest="plot", action="store_false", default=None,
                     help="skip the PNG (the plot needs the 'bench' extra: matplotlib)")
    model = p.add_argument_group("model")
    model.add_argument("--hidden", type=int)
    model.add_argument("--heads", type=int, dest="n_heads")
    model.add_argument("--mlp", type=int, dest="mlp_hidden")
    model.add_argument("--layers", type=int, dest="n_layers")
    model.add_argument("--seq-len", type=int)
    model.add_argument("--vocab", type=int, dest="vocab_size")
    model.add_argument("--ac", dest="activation_checkpointing", action=argparse.BooleanOptionalAction, default=None)
    optim = p.add_argument_group("optimizer")
    optim.add_argument("--lr", type=float)
    optim.add_argument("--adamw-lr", type=float)
    optim.add_argument("--weight-decay", type=float)
    optim.add_argument("--ns-steps", type=int)
    optim.add_argument("--matrix-scope", choices=["blocks", "all_2d"])
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, int | None]:
    """Preset + overrides -> validated BenchConfig (re-running each dataclass's checks)."""
    args = build_parser().parse_args(argv)
    cfg = preset(args.preset)
    d = cfg.to_dict()
    values = vars(args)
    for section in ("model", "optim", "run"):
        for key in d[section]:
            if values.get(key) is not None:
                d[section][key] = values[key]
    if args.modes is not None:
        d["run"]["modes"] = expand_modes(args.modes)
    return BenchConfig.from_dict(d), args.nproc


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:  # the analytic predictor: no GPU, no process group
        from .predict.cli import main as predict_main

        return predict_main(argv[1:])
    from .launch import launched_by_torchrun, spawn
    from .report import check_plot_available
    from .runner import run_benchmark

    cfg, nproc = config_from_args(argv)
    if cfg.run.plot:
        check_plot_available()  # before any rank starts: fail in seconds, not after the run
    if nproc and nproc > 1 and not launched_by_torchrun():
        spawn(nproc, run_benchmark, (cfg,))
    else:
        run_benchmark(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
