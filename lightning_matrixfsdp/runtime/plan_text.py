"""The plan printout (``str(plan)``, what ``log_plan=True`` prints at setup).

A per-rank table of what each shard rank holds between steps (parameter bytes, the cost model's
resident bytes with gradients and optimizer state, optimizer GFLOP per step, matrices stepped),
expert parallelism's local experts included; then the expert stacks (each one's owner, or its
blocks where it is split) or, under expert parallelism, which experts each rank keeps; the
runtime's choices (its ``options``) and each parallel style's note (``plan.notes``); the balance;
and every parameter's role (``plan.roles``). Reads the plan only (a ``placement.Plan``, which
imports this module for its ``__str__``: nothing is imported back).
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_text"]

Plan = Any  # placement.Plan: its __str__ calls plan_text


def _is_matrix(shard: Any) -> bool:
    return shard.role.value == "matrix"


def _role_count(unit: Any) -> int:
    """Matrices, 2D+ tail roles of their own, and the packed small tail."""
    return sum(1 for s in unit.shards if _is_matrix(s) or len(s.shape) >= 2) + int(
        any(not _is_matrix(s) and len(s.shape) < 2 for s in unit.shards))


def _table(plan: Plan) -> list[str]:
    lines = [f"{'rank':>4} | {'params MiB':>10} | {'resident MiB':>12} | {'optimizer GFLOP':>15} | {'matrices':>8}"]
    for r in range(plan.world):
        lines.append(f"{r:>4} | {plan.param_bytes(r) / 2**20:>10.2f} | {plan.resident_bytes(r) / 2**20:>12.2f} | "
                     f"{plan.optimizer_flops(r) / 1e9:>15.3f} | {plan.matrices(r):>8}")
    return lines


def _stacks(plan: Plan) -> list[str]:
    """Each expert stack of the plan: the rank that holds it whole, or its blocks of experts."""
    lines, seen = [], set()
    split = plan.split_stacks
    for s in plan.shards():
        if s.stack is None or s.fqn in seen:
            continue
        seen.add(s.fqn)
        if s.fqn in split:  # each owner's contiguous experts of a split stack
            lines.append(f"split stack {s.fqn}: " + ", ".join(f"rank {o} experts [{a}, {b})"
                                                               for a, b, o in split[s.fqn]))
        else:
            lines.append(f"stack {s.fqn}: whole on rank {s.owner} ({s.shape[0]} experts, not split)")
    return lines


def _role_line(row: Any) -> str:
    """One row of ``classify.describe_roles`` as a printout line."""
    pattern, n, role, why = row[:4]
    line = f"  {pattern}{f' (x{n})' if n > 1 else ''}: {role}, {why}"
    if len(row) == 7:  # the update each way of building the optimizer (older plans: placement only)
        line += f" | Muon(model): {row[4]}, {row[5]} | bare: {row[6]}"
    return line


def plan_text(plan: Plan) -> str:
    """The printout of ``plan`` (module docstring)."""
    o = plan.options
    lines = [f"MatrixFSDP plan: planner={plan.planner} span={plan.world} replicate={plan.replicate} "
             f"units={len(plan.units)} roles={sum(_role_count(u) for u in plan.units)}"]
    lines += _table(plan)
    lines += _stacks(plan)
    if o.get("split_stacks_reason"):  # why no stack is split (TP, replica_split, option off)
        lines.append(f"split_stacks: {o['split_stacks_reason']}")
    if "collective" in o:  # matrix_shard's resolved choice ("auto" or explicit) and why
        lines.append(f"collective: {o['collective']} ({o.get('collective_reason', '')}); "
                     f"replica_split: {plan.replica_split} ({o.get('replica_split_reason', '')})")
    for style in ("tensor_parallel", "expert_parallel"):  # TP: the steppers' balance; EP: the local experts
        lines += [line for note in plan.notes if note.style == style for line in note.lines]
    if plan.steppers:
        per = ", ".join(f"replica {k}: " + " ".join(f"{f / 1e9:.3f}" for f in row)
                        for k, row in enumerate(plan.replica_flops))
        lines.append(f"replica_split: each role stepped by one of {plan.replicate} replicas; "
                     f"optimizer GFLOP per rank: {per}")
    lines.append(f"imbalance (max/avg): memory {plan.memory_imbalance:.3f}, "
                 f"optimizer compute {plan.compute_imbalance:.3f}; max unit gamma {plan.max_gamma:.3f}")
    if plan.roles:  # matrix_shard's classification: every parameter, and the rule that decided
        lines.append("roles (parameter: placement, why | update with Muon(model), why | with bare parameters()):")
        lines += [_role_line(row) for row in plan.roles]
    return "\n".join(lines)
