"""Planner and placement: pure Python, no process group."""
import json

import pytest

from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, RoleKind, UnitSpec
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops
from lightning_matrixfsdp.runtime.planner import make_plan, role_cost


def block(prefix: str, d: int = 64) -> UnitSpec:
    return UnitSpec(prefix, (
        ParamSpec(f"{prefix}.ln1.weight", (d,), "float32", False),
        ParamSpec(f"{prefix}.qkv.weight", (3 * d, d), "float32", True),
        ParamSpec(f"{prefix}.qkv.bias", (3 * d,), "float32", False),
        ParamSpec(f"{prefix}.proj.weight", (d, d), "float32", True),
        ParamSpec(f"{prefix}.fc.weight", (4 * d, d), "float32", True),
        ParamSpec(f"{prefix}.out.weight", (d, 4 * d), "float32", True),
    ))


def model(n: int = 4) -> list[UnitSpec]:
    root = UnitSpec("", (ParamSpec("tok.weight", (256, 64), "float32", True),
                         ParamSpec("ln_f.weight", (64,), "float32", False),
                         ParamSpec("head.weight", (256, 64), "float32", True)))
    return [block(f"blocks.{i}") for i in range(n)] + [root]


@pytest.mark.parametrize("planner", ["role_greedy", "scope_greedy", "cost_aware"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_param_has_one_owner_and_loads_add_up(planner, world):
    units = model()
    plan = make_plan(units, world, planner)
    fqns = [p.fqn for u in units for p in u.params]
    assert sorted(plan.owners) == sorted(fqns)
    assert all(0 <= o < world for o in plan.owners.values())
    # a unit's packed tail (its 0-D/1-D params) has exactly one owner
    for u in plan.units:
        tails = {s.owner for s in u.shards if s.role is RoleKind.TAIL and len(s.shape) < 2}
        assert len(tails) <= 1
    expected = sum(role_cost(RoleKind.MATRIX if p.is_matrix else RoleKind.TAIL, [p])[0]
                   for u in units for p in u.params)
    assert sum(plan.loads_bytes) == expected
    # owner segments: offsets are contiguous per owner within each unit
    for u in plan.units:
        for r in range(world):
            mine = [s for s in u.shards if s.owner == r]
            offs = [s.segment_offset for s in mine]
            assert offs == [sum(x.numel for x in mine[:i]) for i in range(len(mine))]


def test_deterministic_and_json_round_trip():
    a = make_plan(model(), 3, "role_greedy")
    b = make_plan(model(), 3, "role_greedy")
    assert a.to_dict() == b.to_dict() and a.digest() == b.digest()
    back = Plan.from_json(a.to_json())
    assert back.to_dict() == a.to_dict() and back.digest() == a.digest()
    json.loads(a.to_json())  # plain JSON


def test_role_greedy_balances_each_unit_and_reports_figures():
    plan = make_plan(model(8), 4, "role_greedy")
    assert plan.memory_imbalance < 1.15, str(plan)
    assert all(g < 2.0 for g in plan.gammas.values())
    text = str(plan)
    assert "imbalance" in text and "gamma" in text and text.count("\n") >= 6


def test_scope_greedy_balances_globally_at_least_as_well():
    units = model(3)
    role, scope = make_plan(units, 4, "role_greedy"), make_plan(units, 4, "scope_greedy")
    assert scope.memory_imbalance <= role.memory_imbalance + 1e-9


def test_cost_aware_respects_gamma_cap():
    units = model(3)
    plan = make_plan(units, 4, "cost_aware", gamma_cap=1.0)
    role = make_plan(units, 4, "role_greedy")
    assert plan.planner == "cost_aware" and plan.options["chosen"] in ("role_greedy", "scope_greedy")
    assert plan.max_gamma <= max(1.0, role.max_gamma) + 1e-9


def test_more_ranks_than_roles_leaves_ranks_empty():
    units = [UnitSpec("", (ParamSpec("w", (4, 4), "float32", True), ParamSpec("b", (4,), "float32", False)))]
    plan = make_plan(units, 5, "role_greedy")
    assert sorted(plan.loads_bytes).count(0) == 3
    assert plan.units[0].segment_numel(4) == 0


def test_newton_schulz_flops_formula():
    # m <= n: steps * (4 m^2 n + 2 m^3), independent of orientation
    assert newton_schulz_flops((100, 300), 5) == 5 * (4 * 100 * 100 * 300 + 2 * 100 ** 3)
    assert newton_schulz_flops((300, 100), 5) == newton_schulz_flops((100, 300), 5)
    assert newton_schulz_flops((7,), 5) == 0


def test_frozen_roles_cost_only_their_weights():
    p = ParamSpec("w", (8, 8), "float32", True, requires_grad=False)
    assert role_cost(RoleKind.MATRIX, [p]) == (256, 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown planner"):
        make_plan(model(), 2, "best")
    with pytest.raises(ValueError, match="more than one unit"):
        make_plan([block("a"), block("a")], 2)
    with pytest.raises(ValueError, match=">= 1"):
        make_plan(model(), 0)


def test_large_non_matrix_params_are_roles_of_their_own():
    # embedding and head sent to AdamW: each its own tail role, not packed with the norms
    units = [UnitSpec("", (ParamSpec("tok.weight", (1000, 64), "float32", False),
                           ParamSpec("ln_f.weight", (64,), "float32", False),
                           ParamSpec("head.weight", (1000, 64), "float32", False)))]
    plan = make_plan(units, 2)
    owners = plan.owners
    assert owners["tok.weight"] != owners["head.weight"]
    assert plan.units[0].gamma < 1.1
