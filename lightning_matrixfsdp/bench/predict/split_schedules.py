"""The predictor's split-backward V schedules (``ZBVZeroBubble``, ``DualPipeV``): their action
order, their idle time simulated on it, and what the split costs a stage under owner sharding.

**Action order.** Both put two stages on each of the ``PP`` ranks in a V: rank ``r`` runs stage
``r`` (going down) and stage ``2 PP - 1 - r`` (coming back), so the first and the last stage share
rank 0. Actions are ``F`` (forward), ``I`` (input gradient), ``W`` (weight gradient) and ``B``
(whole backward, ``I`` then ``W`` at once). :func:`v_order` writes the order torch's schedule
classes run (torch 2.11 and 2.13 build the same lists; tests/test_predict_pp_split.py compares them
action by action): ZBV warms up with forwards of the first stage, then runs ``F I W`` of each
stage in turn, and cools down with input gradients before the weight gradients they left;
DualPipeV pairs a forward of one stage with a whole backward of the other in its steady phase
(torch runs the pair one after the other: nothing overlaps in its runtime or ours) and splits
only the backwards of its first and last phases.

**Idle time** (:func:`simulate`): every rank runs its list in order; an action starts when its
rank is free and its inputs exist (a forward after the previous stage's forward of that
micro-batch, an input gradient after its forward and the next stage's input gradient, a weight
gradient after its input gradient). torch skips the first stage's input gradient (that stage has
no input to differentiate) and runs its whole backward as the weight part, so stage 0's ``I``
costs nothing and its ``W`` costs ``b + w``. The idle time is the makespan less a rank's work,
``2 m (f + b + w)``: no closed form, it depends on ``PP``, ``m`` and the three durations.

**The split under owner sharding** (:func:`split_parts`, as runtime/pipeline/split_backward.py
runs it): the input part materializes the units as backward reaches them and reduces nothing;
the weight part materializes every unit first, one after the other (compute waits for all),
computes the weight gradients, and only then reduces each unit to its owners. Against a whole
backward that is one more materialization of the stage per micro-batch, and reductions that no
compute hides. The first stage's backward is whole, as under 1F1B.
"""

from __future__ import annotations

import functools

__all__ = ["V_SCHEDULES", "simulate", "split_parts", "split_share", "v_bubble", "v_in_flight", "v_order"]

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
Action = tuple[str, int, int]  # (kind, stage, micro-batch)


def _zbv_rank(pp: int, m: int, r: int) -> list[Action]:
    """ZBV's list for rank ``r``: built for ``max(m, 2 PP - 1)`` micro-batches, then the actions of
    micro-batches ``>= m`` dropped (torch pads small ``m`` so the V fills, then removes them)."""
    n, down, up = max(2 * pp - 1, m), r, 2 * pp - 1 - r
    cnt = {"fd": 0, "fu": 0, "bd": 0, "bu": 0}
    ops: list[Action] = []

    def add(kind: str, stage: int, key: str | None) -> None:
        ops.append((kind, stage, cnt[key] if key else 0))

    def step(kind: str, stage: int, key: str) -> None:
        add(kind, stage, key)
        cnt[key] += 1

    for _ in range(2 * (pp - r) - 1):
        step("F", down, "fd")
    for _ in range(r):
        step("F", up, "fu")
        step("F", down, "fd")
    for _ in range(pp - r):
        step("F", up, "fu")
        ops += [("I", up, cnt["bu"]), ("W", up, cnt["bu"])]
        cnt["bu"] += 1
    while cnt["fu"] < cnt["fd"] or cnt["fd"] < n:
        if cnt["fd"] < n:
            step("F", down, "fd")
        ops += [("I", down, cnt["bd"]), ("W", down, cnt["bd"])]
        cnt["bd"] += 1
        step("F", up, "fu")
        ops += [("I", up, cnt["bu"]), ("W", up, cnt["bu"])]
        cnt["bu"] += 1
    wd, wu = cnt["bd"], cnt["bu"]
    for _ in range(r):
        step("I", down, "bd")
        step("I", up, "bu")
    for _ in range(pp - r):
        step("I", down, "bd")
        ops.append(("W", down, wd))
        wd += 1
    ops += [("W", up, i) for i in range(wu, cnt["bu"])] + [("W", down, i) for i in range(wd, cnt["bd"])]
    return [a for a in ops if a[2] < m]


def _dualpipev_rank(pp: int, m: int, r: int) -> list[Action]:
    """DualPipeV's list for rank ``r`` (``m >= 2 PP``); a steady pair ``F`` + ``B`` is two actions."""
    down, up = r, 2 * pp - 1 - r
    nxt: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # input gradients whose weight part is still to run
    ops: list[Action] = []

    def act(stage: int, kind: str) -> None:
        i = nxt.get((stage, "I" if kind == "B" else kind), 0)
        ops.append((kind, stage, i))
        nxt[(stage, "I" if kind == "B" else kind)] = i + 1
        if kind == "I":
            pending.append((stage, i))

    def weight() -> None:
        if pending:
            stage, i = pending.pop(0)
            ops.append(("W", stage, i))

    for _ in range(2 * (pp - r - 1)):
        act(down, "F")
    for _ in range(r + 1):
        act(down, "F")
        act(up, "F")
    for _ in range(pp - r - 1):
        act(up, "I")
        weight()
        act(up, "F")
    for _ in range(m - 2 * pp + r + 1):
        act(down, "F")
        act(up, "B")
        act(up, "F")
        act(down, "B")
    for _ in range(pp - r - 1):
        act(up, "B")
        act(up, "F")
        act(down, "B")
    split = False
    for i in range(r + 1):  # the last backwards: whole until the middle, then split (odd ranks one earlier)
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        act(up, "I" if split else "B")
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        act(down, "I" if split else "B")
    for _ in range(pp - r - 1):
        weight()
        act(down, "I" if split else "B")
    for _ in range(r + 1):
        weight()
    return ops


@functools.lru_cache(maxsize=256)
def v_order(schedule: str, pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions, in the order torch's ``schedule`` runs them."""
    build = {"ZBVZeroBubble": _zbv_rank, "DualPipeV": _dualpipev_rank}[schedule]
    return tuple(tuple(build(pp, m, r)) for r in range(pp))


def simulate(order: tuple[tuple[Action, ...], ...], stages: int, f: float, b: float, w: float) -> float:
    """Makespan of ``order`` at chunk durations ``f``, ``b``, ``w`` (stage 0: ``I`` free, ``W`` whole)."""
    def dur(kind: str, k: int) -> float:
        if kind == "I":
            return 0.0 if k == 0 else b
        if kind == "W":
            return b + w if k == 0 else w
        return f if kind == "F" else b + w

    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * len(order), [0.0] * len(order)
    while any(p < len(ops) for p, ops in zip(pos, order)):
        moved = False
        for r, ops in enumerate(order):
            while pos[r] < len(ops):
                kind, k, i = ops[pos[r]]
                if kind == "F":
                    deps = [("F", k - 1, i)] if k else []
                elif kind == "W":
                    deps = [("I", k, i)]
                else:
                    deps = [("F", k, i)] + ([("I", k + 1, i)] if k < stages - 1 else [])
                if not all(d in done for d in deps):
                    break
                free[r] = max([free[r]] + [done[d] for d in deps]) + dur(kind, k)
                done[(kind, k, i)] = free[r]
                if kind == "B":
                    done[("I", k, i)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the action order deadlocks")  # a wrong order; never torch's
    return max(free)


@functools.lru_cache(maxsize=4096)
def v_bubble(schedule: str, pp: int, m: int, f: float, b: float, w: float) -> float:
    """A rank's idle time over the step: the simulated makespan less ``2 m (f + b + w)``."""
    return simulate(v_order(schedule, pp, m), 2 * pp, f, b, w) - 2 * m * (f + b + w)


def v_in_flight(schedule: str, pp: int, m: int, rank: int) -> int:
    """Chunk activations rank ``rank`` holds at its peak: forwards done whose weight part (or whole
    backward) has not run yet."""
    held = peak = 0
    for kind, _, _ in v_order(schedule, pp, m)[rank]:
        held += 1 if kind == "F" else -1 if kind in ("W", "B") else 0
        peak = max(peak, held)
    return peak


def split_share(schedule: str, pp: int, m: int, rank: int) -> tuple[float, float]:
    """(share of the rank's first stage's micro-batches, of its second's) whose backward runs split
    (an ``I`` and a later ``W``); stage 0 never does (torch runs its weight part as a whole
    backward)."""
    ops = v_order(schedule, pp, m)[rank]
    down, up = rank, 2 * pp - 1 - rank
    share = [sum(1 for k, s, _ in ops if k == "I" and s == st) / m for st in (down, up)]
    return (0.0 if down == 0 else share[0]), share[1]


def split_parts(cb_in: list[float], w_unit: list[float], copy: list[float], link: list[float], root: list[bool],
                reduce_chain: float, pipeline_fn) -> tuple[float, float]:
    """(input part, weight part) seconds of one chunk and micro-batch, as our runtime runs them.

    ``cb_in``/``w_unit``: each unit's input-gradient / weight-gradient compute; ``copy``: its
    materialized bytes copied once; ``link``: one materialization (= one reduction) of it; ``root``:
    whether it is the root unit (held from the forward, as in a whole backward); ``reduce_chain``: the
    reductions (and HSDP's replica collectives) run one after another with no compute left to hide
    them. The input part overlaps materialization with compute as a backward does, reducing nothing;
    the weight part materializes every unit before computing, then reduces."""
    order = list(range(len(cb_in)))[::-1]
    inp = pipeline_fn([cb_in[u] + (0.0 if root[u] else copy[u]) for u in order],
                      [0.0 if root[u] else link[u] for u in order], [0.0] * len(order))
    weight = sum(link) + sum(copy) + sum(w_unit) + reduce_chain
    return inp, weight
