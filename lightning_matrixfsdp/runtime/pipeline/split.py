"""Which blocks go to which pipeline stage: pure, no module surgery and no process group.

A model is seen as ``pre`` (embeddings), a sequence of repeated blocks, and ``post`` (final
norm and head). Stage 0 holds ``pre``, the last stage holds ``post``, and every stage holds
a contiguous, non-empty run of blocks. The runs come from declared split points (the first
block of each stage after the first, ``["model.layers.8", ...]``) or, without them, from a
balance of parameter counts: the contiguous partition whose largest stage (its blocks, plus
``pre`` on the first and ``post`` on the last) holds the fewest parameters. Parameters stand for
memory (weights, gradients and optimizer state all scale with them); time is close to
proportional to them for a decoder whose blocks are alike, which is why one measure serves both.
The plan's description reports each stage's memory share (parameters) and an estimate of its
time share (matmul FLOPs per token: 2 x the parameters of its blocks and head, the embeddings
being a lookup), so a user sees where the balance by parameters leaves the compute uneven.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["StagePlan", "StageSpan", "plan_stages"]


@dataclass(frozen=True)
class StageSpan:
    """One stage: its blocks (global module names, in model order) and what else it holds."""

    index: int
    blocks: tuple[str, ...]
    first: bool
    last: bool
    #: parameter elements the stage holds (its blocks, plus pre / post where it has them)
    params: int
    #: ``params`` over the whole model's: the stage's memory share (weights, gradients and optimizer
    #: state all scale with its parameters)
    share: float
    #: an estimate of the stage's share of a step's compute: its matmul FLOPs per token, 2 x its
    #: blocks' and head's parameters (``post``), over the whole model's; the embeddings are a lookup
    #: (none), attention scores are not counted, and a mixture of experts counts every expert
    time_share: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """The stages of one pipeline and how the split was chosen."""

    stages: tuple[StageSpan, ...]
    #: "declared" or "balanced by parameter count"
    how: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> str:
        """The plan as lines: each stage's blocks and its share of the parameters (memory)."""
        lines = [f"pipeline: {self.num_stages} stages, split {self.how}"]
        for s in self.stages:
            what = ([("embeddings")] if s.first else []) + [_run(s.blocks)] + (["norm + head"] if s.last else [])
            lines.append(f"  stage {s.index}: {', '.join(what)}; {s.params:,} parameters (memory "
                         f"{100 * s.share:.1f}%), time ~{100 * s.time_share:.1f}% (estimate)")
        lines.append("  memory: the stage's share of the parameters (weights, gradients and optimizer state scale "
                     "with them); time (estimate): its share of the matmul FLOPs per token, 2 x the parameters of its "
                     "blocks and head (embeddings are a lookup; attention scores not counted; every expert counted)")
        return "\n".join(lines)


def _run(blocks: Sequence[str]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)} blocks)"


def plan_stages(blocks: Sequence[tuple[str, int]], pre: int, post: int, num_stages: int,
                split: Optional[Sequence[str]] = None, modules: Collection[str] = ()) -> StagePlan:
    """The stages for ``blocks`` ((name, parameter count) in model order), ``pre`` / ``post``
    parameter counts, ``num_stages`` stages; ``split``: the declared first block of each stage
    after the first (None: balanced). ``modules``: every module name of the model, so that a
    split point naming a module that is not a block is told apart from one naming nothing.
    Refuses (:class:`MatrixShardError`) more stages than blocks and every bad split point."""
    names = [n for n, _ in blocks]
    if num_stages < 1:
        raise MatrixShardError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if num_stages > len(names):
        raise MatrixShardError(f"{num_stages} pipeline stages for a model of {len(names)} blocks: every stage needs "
                               f"at least one block; use at most {len(names)} stages (pipeline size x stages per rank)")
    if split is not None:
        starts, how = _declared(names, list(split), num_stages, modules), "declared"
    else:
        starts, how = _balanced([c for _, c in blocks], pre, post, num_stages), "balanced by parameter count"
    total = pre + post + sum(c for _, c in blocks)
    flops = post + sum(c for _, c in blocks)  # per token, over 2: the embeddings' lookup costs none
    bounds = list(starts) + [len(names)]
    stages = []
    for i in range(num_stages):
        run = blocks[bounds[i]:bounds[i + 1]]
        matmul = sum(c for _, c in run) + (post if i == num_stages - 1 else 0)
        params = matmul + (pre if i == 0 else 0)
        stages.append(StageSpan(i, tuple(n for n, _ in run), i == 0, i == num_stages - 1, params,
                                params / total if total else 0.0, matmul / flops if flops else 0.0))
    return StagePlan(tuple(stages), how)


def _declared(names: list[str], split: list[str], num_stages: int, modules: Collection[str]) -> list[int]:
    """Block index where each stage starts, from the declared split points."""
    if len(split) != num_stages - 1:
        raise MatrixShardError(f"pipeline_split names {len(split)} split points for {num_stages} stages; give "
                               f"{num_stages - 1}: the first block of each stage after the first (e.g. {names[1]!r})")
    starts = [0]
    for point in split:
        if point not in names:
            if point in modules:
                raise MatrixShardError(f"pipeline_split point {point!r} is a module but not one of the repeated "
                                       f"blocks a stage can start at; the blocks are {names[0]!r} .. {names[-1]!r}")
            raise MatrixShardError(f"pipeline_split point {point!r} names no module of the model; a split point is "
                                   f"a block's name, {names[0]!r} .. {names[-1]!r}")
        at = names.index(point)
        if at == 0:
            raise MatrixShardError(f"pipeline_split point {point!r} is the first block, where stage 0 starts anyway; "
                                   "name the first block of each stage after the first")
        if at <= starts[-1]:
            raise MatrixShardError(f"pipeline_split points out of order or repeated: {point!r} does not come after "
                                   f"{names[starts[-1]]!r}; list them in model order")
        starts.append(at)
    return starts


def _balanced(counts: list[int], pre: int, post: int, num_stages: int) -> list[int]:
    """Block index where each stage starts: the contiguous partition minimizing the largest stage
    (ties: the earliest boundaries, so the same on every rank)."""
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, stage: int) -> int:  # blocks i..j-1 as stage `stage`
        return prefix[j] - prefix[i] + (pre if stage == 0 else 0) + (post if stage == num_stages - 1 else 0)

    # best[s][j]: the smallest largest-stage for blocks 0..j-1 in stages 0..s-1; cut[s][j]: where stage s-1 starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(i, j, s - 1))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return starts[::-1]
