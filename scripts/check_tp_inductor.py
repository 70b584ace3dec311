"""By hand, not in the suite: compiled blocks with tensor parallelism through inductor (the suite
compiles with ``aot_eager``: inductor's first C++ build of a graph takes ~25 s per process on the
CI machine). Runs ``tests/helpers/tp_compose_scenarios.py``'s compiled-block scenario at world 4 = D 2 x T 2 (gloo,
CPU) with ``backend="inductor"`` and prints, per rank, whether the losses and held fragments equal
the eager reference's after 3 steps and the largest weight difference.

    python scripts/check_tp_inductor.py      # ~1 min on 2 cores
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _inductor(model) -> list:
    import torch

    b = model.blocks[0]
    b.forward = torch.compile(b.forward, backend="inductor", dynamic=False)
    return []


def worker(rank: int, world: int) -> dict:
    from helpers import tp_compose_scenarios as tp_compose
    from helpers.tp_scenarios import _mesh

    tp_compose._compile_blocks = _inductor
    out = tp_compose.run(_mesh(), 3, compiled=True)
    return {"loss_equal": out["loss_equal"], "weights_equal": out["weights_equal"],
            "max_weight_diff": max([b[2] for b in out["bad"]] or [0.0])}


if __name__ == "__main__":
    from helpers.dist import run_distributed

    print(json.dumps(run_distributed(worker, 4, timeout=580), indent=1))
