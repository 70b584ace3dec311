"""``replica_split`` under HSDP: each role stepped by one replica, bitwise equal to DDP.

The oracle (``tests/oracle.py``) is DDP on full replicas. With ``W = 1`` its flat
rank-order sum is exactly what the stepping replica computes, so the comparison uses
the oracle's own all-reduce. With ``W > 1`` the stepper adds the shard groups' partial
sums in replica order, ``(g_0 + ... + g_{W-1}) + (g_W + ... ) + ...``: the oracle here
then sums in that grouping (``grouped_mean_grads``, written independently of the
runtime), which is still a data-parallel mean, only with its terms grouped per node.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from equiv import count_collectives
from models import TinyLM, batch_for, lm_loss
from oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, clip_global_norm, oracle_optimizers


# ---------------------------------------------------------------------- pure: the assignment
def _units(shapes_per_unit):
    from lightning_matrixfsdp.runtime.placement import ParamSpec, UnitSpec

    return [UnitSpec(f"u{i}", tuple(ParamSpec(f"u{i}.p{j}", s, "float32", len(s) == 2) for j, s in enumerate(shapes)))
            for i, shapes in enumerate(shapes_per_unit)]


def test_assignment_balances_newton_schulz_flops_per_shard_rank():
    from lightning_matrixfsdp.runtime.planner import make_plan, newton_schulz_flops
    from lightning_matrixfsdp.runtime.replicas import assign_steppers

    units = _units([[(64, 64), (64, 256), (256, 64), (64, 64), (64,)], [(128, 128), (32, 32), (32,)]])
    plan = make_plan(units, 1, "role_greedy")
    steppers, flops = assign_steppers(plan, units, 2)
    # independent brute force over all 2-way splits of the roles of shard rank 0 (W = 1: all of them)
    roles = [("u0.p0",), ("u0.p1",), ("u0.p2",), ("u0.p3",), ("u1.p0",), ("u1.p1",), ("u0.p4",), ("u1.p2",)]
    cost = {"u0.p0": newton_schulz_flops((64, 64)), "u0.p1": newton_schulz_flops((64, 256)),
            "u0.p2": newton_schulz_flops((64, 256)), "u0.p3": newton_schulz_flops((64, 64)),
            "u1.p0": newton_schulz_flops((128, 128)), "u1.p1": newton_schulz_flops((32, 32)),
            "u0.p4": 12 * 64, "u1.p2": 12 * 32}
    total = sum(cost.values())
    best = min(max(sum(cost[r[0]] for i, r in enumerate(roles) if m >> i & 1),
                   total - sum(cost[r[0]] for i, r in enumerate(roles) if m >> i & 1)) for m in range(2 ** len(roles)))
    got = [sum(c for k, c in cost.items() if steppers[k] == rep) for rep in (0, 1)]
    assert got == [row[0] for row in flops]
    assert sum(got) == total and max(got) <= 1.1 * best, (got, best)
    assert set(steppers) == {p.fqn for u in units for p in u.params}


def test_assignment_is_deterministic_and_per_shard_rank():
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.replicas import assign_steppers

    units = _units([[(16, 16)] * 5 + [(16,)], [(8, 16)] * 3])
    plan = make_plan(units, 2, "role_greedy")
    a = assign_steppers(plan, units, 3)
    assert a == assign_steppers(plan, units, 3)
    steppers, flops = a
    assert len(flops) == 3 and all(len(r) == 2 for r in flops)
    # every replica steps something on each shard rank that owns at least 3 roles
    for r in range(2):
        mine = [p.fqn for u in units for p in u.params if plan.shard(p.fqn).owner == r and len(p.shape) == 2]
        if len(mine) >= 3:
            assert {steppers[f] for f in mine} == {0, 1, 2}
    # equal roles go largest first, ties by replica index: the first of five equal matrices to replica 0
    assert steppers["u0.p0"] == 0
    # tail params of a unit share one stepper (one role)
    assert len({steppers[p.fqn] for u in units for p in u.params if len(p.shape) < 2 and p.fqn.startswith("u0")}) == 1


def test_plan_records_steppers_in_dict_digest_and_text():
    from lightning_matrixfsdp.runtime.placement import Plan, first_difference
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.replicas import assign_steppers

    units = _units([[(16, 16), (16, 32), (16,)]])
    plan = make_plan(units, 1, "role_greedy", replicate=2)
    digest_off = plan.digest()
    assert not plan.replica_split and plan.stepper("u0.p0") is None and "steppers" not in plan.to_dict()
    plan.steppers, plan.replica_flops = assign_steppers(plan, units, 2)
    assert plan.replica_split and plan.digest() != digest_off
    back = Plan.from_json(plan.to_json())
    assert back.steppers == plan.steppers and back.replica_flops == plan.replica_flops
    assert back.digest() == plan.digest()
    other = Plan.from_dict(plan.to_dict())
    other.steppers = {k: 1 - v for k, v in plan.steppers.items()}
    assert other.digest() != plan.digest()
    assert "stepping replica" in first_difference(plan.to_dict(), other.to_dict())
    assert "replica_split" in str(plan)


def test_option_is_checked():
    from lightning_matrixfsdp.runtime.options import MatrixShardError, check_shard_options

    assert check_shard_options(replica_split=True)["replica_split"] is True
    with pytest.raises(MatrixShardError, match="replica_split='yes'"):
        check_shard_options(replica_split="yes")
