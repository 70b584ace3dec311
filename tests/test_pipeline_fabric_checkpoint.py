"""``fabric.save`` / ``fabric.load`` under pipeline parallelism (issue 38, item 5 through Fabric).

At PP=2 (2 gloo processes) and PP=2 x HSDP (4 processes, ``shard_size=1``: two replicas of each
stage, ``replica_split`` on), a Fabric loop saves after 2 of 4 steps with ``fabric.save`` (the
Trainer's directory format, global names); a fresh run loads it and trains the last 2 steps. The
oracles (``helpers/pipeline_fabric_ckpt_scenarios.py``): the run that never stopped (losses,
weights, optimizer state bitwise), the unsplit model on one process (the uninterrupted run's
losses and weights bitwise, from ``model.state_dict()`` right after the loop (under HSDP the
replica that did not step a weight must give the stepped value) and from the tensors after
``sync_replicas(model)``), and the saving run's own weights, which the directory loaded
at ``pipeline_parallel_size=1`` holds, every one, by name.
"""
from __future__ import annotations

import pytest
import torch

from helpers.pipeline_fabric_ckpt_scenarios import fabric_resume


def _merge(res: list, phase: str, part: str) -> dict:
    """One value per global name; every rank that holds a name (replicas) must hold the same bits."""
    out: dict = {}
    for rank, r in enumerate(res):
        for k, v in r[phase][part].items():
            if k in out:
                assert torch.equal(out[k], v), f"{phase} {part} {k}: rank {rank} differs from another rank"
            else:
                out[k] = v
    return out


def _equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) and want, f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} differ, e.g. {bad[:4]}"


@pytest.mark.parametrize("world, case", [
    (2, {"pp": 2, "options": {"save_distributed_checkpoint": False}}),  # one consolidated file
    (4, {"pp": 2, "options": {"shard_size": 1}}),  # the directory
], ids=["pp2-file", "pp2xhsdp-directory"])
def test_fabric_save_load_resumes_bitwise_and_reshards(dist_pools, tmp_path, world, case):
    from helpers.pipeline_lightning_scenarios import make_module

    res = dist_pools(world).run(fabric_resume, {**case, "dir": str(tmp_path)}, timeout=400)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    names = sorted(n for n, _ in make_module().named_parameters())
    for rank, r in enumerate(res):
        assert r["whole_losses"] == r["oracle_losses"], (rank, r["whole_losses"], r["oracle_losses"])
        assert r["oracle_worst"] == {"state_dict": 0.0, "tensors": 0.0}, (rank, "weights after the loop differ from "
                                                                           "the unsplit oracle", r["oracle_worst"])
        assert r["resumed_losses"] == r["whole_losses"][2:], (rank, r["resumed_losses"], r["whole_losses"])
        assert r["step"] == 2 and r["rest"] == [], (rank, r["step"], r["rest"])
        assert r["lr"] == [0.02 * 0.25] * len(r["lr"]), (rank, r["lr"])  # the scheduler's state came back
    whole, saved = _merge(res, "whole", "weights"), _merge(res, "saved", "weights")
    assert sorted(whole) == names  # every stage's weights, each held somewhere
    _equal(_merge(res, "loaded", "weights"), saved, "loaded weights")
    _equal(_merge(res, "loaded", "state"), _merge(res, "saved", "state"), "loaded optimizer state")
    _equal(_merge(res, "resumed", "weights"), whole, "weights after resuming")
    _equal(_merge(res, "resumed", "state"), _merge(res, "whole", "state"), "optimizer state after resuming")
    _equal(_merge(res, "pp1", "weights"), saved, "weights loaded at pipeline_parallel_size=1")
    _equal(_merge(res, "pp1", "state"), _merge(res, "saved", "state"), "optimizer state at pipeline_parallel_size=1")
