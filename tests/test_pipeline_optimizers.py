"""Shampoo and SOAP under pipeline parallelism (issue 38, item 4): each stage's matrices stepped
where their owners are, the recipe applied per stage as in one piece, equal to the library.

The oracle (helpers/pipeline_scenarios.py ``library_optimizers``) is pytorch-optimizer's own
``SOAP`` / ``ScalableShampoo`` on every recipe matrix of the unsplit model in one process, with
torch's AdamW on the embedding, the head and the 1-D tensors; ours is the package's wrapper built
from each rank's stages (``SOAP(run.module)``), as a user builds it in ``configure_optimizers``.
Both per-matrix optimizers depend only on their matrix's gradient and state, so after two steps
the weights are float32-bitwise equal, and the step moves 0 bytes. The Muon cases are in
test_pipeline_exact.py.
"""
from __future__ import annotations

import pytest

from helpers.pipeline_scenarios import run_case

pytest.importorskip("pytorch_optimizer")

CASES = {
    "soap-pp2xdp2-1f1b": (4, {"model": "demo_gpt", "pp": 2, "schedule": "1F1B", "optimizer": "soap"}),
    "shampoo-pp2-gpipe": (2, {"model": "demo_gpt", "pp": 2, "schedule": "GPipe", "optimizer": "shampoo"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matrix_optimizers_per_stage_equal_the_library_on_the_unsplit_model(dist_pools, name):
    world, case = CASES[name]
    res = dist_pools(world).run(run_case, case, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["losses"] == r["oracle_losses"], f"{name} rank {rank}: {r['losses']} vs {r['oracle_losses']}"
        assert not r["differs"], f"{name} rank {rank}: " + "; ".join(r["differs"][:8])
        assert r["routed_is_mine"], f"{name} rank {rank}: the optimizer holds parameters of no stage of this rank"
        assert r["step_collectives"] == 0 and r["step_bytes"] == 0, f"{name} rank {rank}: the step communicated"
