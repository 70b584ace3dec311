"""Questions about a sharded model and what the layers above may do to it: its plan, its
traffic, the no-sync switch, the ``replica_split`` weight transfers (start, wait, and
settle until the replicas are equal), which forwards a training loop schedules on every
rank (the lone-forward check), the groups a gradient norm sums over, the buffer
broadcast, and releasing a forward left without backward.

The one way into a sharded model's runtime state from outside ``runtime/``: the adapters,
the optimizers and the checkpoints call these functions (and ``views/checkpoint``'s records),
never the state object itself."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.comm.core import CommStats

from lightning_matrixfsdp.runtime.consensus import PeerCheck, host_group, world_host_group
from lightning_matrixfsdp.runtime.experts.stats import summarize
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.comm.small import gather_objects, sum_counts
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.tags import find_state, is_stage, sharded_roots, stage_index, state_of, tp_of


def _state(module: nn.Module) -> MatrixFSDPState:
    st = find_state(module)
    if st is None:
        raise ValueError("this module was not sharded with matrix_shard")
    return st


def get_plan(module: nn.Module) -> Plan:
    """The owner plan of a sharded model (``str(plan)`` prints a table)."""
    return _state(module).plan


def get_comm_stats(module: nn.Module, reset: bool = False) -> dict[str, dict[str, int]]:
    """Bytes sent/received and collective calls per phase on this rank."""
    st = _state(module)
    snap = st.stats.snapshot()
    if reset:
        st.stats.reset()
    return snap


def get_expert_stats(module: nn.Module, steps: int = 1) -> dict[str, float]:
    """The experts' load since the last call, over the whole world, as metrics for a logger
    (``matrix_fsdp/experts/...``; docs/moe.md, "Expert statistics"): per experts module the tokens
    of the least and the most loaded expert per step and the coefficient of variation of the
    tokens per expert, the worst coefficient, and the slots routed to no expert if any. ``steps``:
    the optimizer steps the counts span (the per-step figures divide by it). Counted in training
    forwards only. Collective: every rank must call it (one small all-reduce of the counts); an
    empty dict, with no communication, for a model without experts modules (under pipeline
    parallelism always one small all-gather: a stage cannot know whether the others have experts)."""
    return expert_stats_of(sharded_roots(module), steps)


def expert_stats_of(roots: Iterable[nn.Module], steps: int = 1) -> dict[str, float]:
    """:func:`get_expert_stats` of the sharded ``roots``. Under pipeline parallelism (the roots are
    this rank's stages) every rank's counts are gathered over the world and summed by module, so each
    stage's experts are counted over its own ranks (a world all-reduce would add one stage's counts
    to another's), and every rank gets every stage's metrics; always collective there."""
    roots = list(roots)
    if any(is_stage(r) for r in roots):
        return _stage_expert_stats(roots, steps)
    names, experts, flats = [], [], []
    tp = 1
    for root in roots:
        st = state_of(root)
        if st.routing is None or not st.routing.num_experts:
            continue
        n, e, flat = st.routing.take()
        names += n
        experts += e
        flats.append(flat)
        tp = st.mesh.tp_size
    if not names:
        return {}
    total = sum_counts(torch.cat(flats))  # the world's tokens; the ranks of a TP group route the same ones
    return summarize(names, experts, [c // tp for c in total], steps)


def _stage_expert_stats(roots: list[nn.Module], steps: int) -> dict[str, float]:
    """Every rank's counts by experts module (global names: each stage names its modules as the
    whole model does), summed over the ranks that report the module: its stage's."""
    mine = []
    for root in roots:
        st = state_of(root)
        if st.routing is not None and st.routing.num_experts:
            n, e, flat = st.routing.take()
            mine.append((n, e, flat.tolist()))
    totals: dict[str, tuple[int, list[int]]] = {}  # module -> (experts, counts summed over its stage's ranks)
    for rows in gather_objects(mine):
        for n, e, flat in rows:
            start = 0
            for name, k in zip(n, e):
                row, start = flat[start:start + k + 1], start + k + 1
                have = totals.get(name, (k, [0] * (k + 1)))[1]
                totals[name] = (k, [a + b for a, b in zip(have, row)])
    if not totals:
        return {}
    names = list(totals)
    return summarize(names, [totals[n][0] for n in names], [c for n in names for c in totals[n][1]], steps)


def by_stage(roots: Iterable[nn.Module], describe: Callable[[nn.Module], Any]) -> dict[int, Any]:
    """Under pipeline parallelism: stage index -> ``describe(stage)`` (picklable) on the lowest global
    rank that runs the stage (as the unpipelined reports are global rank 0's), every stage's, in stage
    order, on every rank. Collective over the world (one all-gather of the small records); ``{}``
    without pipeline stages among ``roots`` (then local)."""
    mine = {index: describe(r) for r in roots if (index := stage_index(r)) is not None}
    if not mine:
        return {}
    out: dict[int, Any] = {}
    for rows in gather_objects(mine):  # rank order: the lowest rank's first
        for index, record in rows.items():
            out.setdefault(index, record)
    return dict(sorted(out.items()))


def stage_comm_stats(roots: Iterable[nn.Module]) -> dict[int, dict[str, dict[str, int]]]:
    """:func:`by_stage` of :func:`get_comm_stats`: each stage's traffic counters (collective)."""
    return by_stage(roots, get_comm_stats)


def set_requires_gradient_sync(module: nn.Module, value: bool) -> None:
    """``False`` accumulates full unsharded gradients locally (no-sync micro-batches)."""
    _state(module).set_requires_gradient_sync(value)


def is_matrix_sharded(module: nn.Module) -> bool:
    """True if ``module`` or a module inside it was sharded by ``matrix_shard``."""
    try:
        _state(module)
        return True
    except ValueError:
        return False


def _optimizer_params(optimizer: Any) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def start_replica_sync(module: nn.Module, optimizer: Optional[Any] = None) -> None:
    """``replica_split``: start sending the weights the stepping replicas updated (those of
    ``optimizer``'s parameters, if given) to the other replicas, without waiting. Call it on
    every rank right after ``optimizer.step()``; the root's next forward does it otherwise.
    No-op without ``replica_split``."""
    _state(module).start_replica_sync(_optimizer_params(optimizer) if optimizer is not None else None)


def sync_replicas(module: nn.Module) -> None:
    """``replica_split``: every replica holds the current weights when this returns (sends
    what may have changed, waits for every transfer in flight). Collective over the
    replicas: call it on every rank. No-op without ``replica_split``. Under pipeline
    parallelism ``module`` may be (or hold) the whole model: this rank's stages are synced."""
    stages = _stages_in(module)
    if stages:
        for stage in stages:
            state_of(stage).settle_replicas()
        return
    _state(module).settle_replicas()


def _stages_in(module: nn.Module) -> list[nn.Module]:
    """The sharded pipeline stages this rank runs of every model inside ``module`` split by
    ``build_pipeline`` (a stage is a root of its own, not a submodule of the model)."""
    return [r for r in sharded_roots(module) if is_stage(r)]


def watch_lone_forwards(module: nn.Module) -> None:
    """From now on, a forward of each sharded model inside ``module`` that does not run
    inside :func:`scheduled_forwards` first meets the other ranks of its shard group, and
    raises ``LoneForwardError`` if they do not come within seconds (``consensus.PeerCheck``).
    Under pipeline parallelism (the roots are this rank's stages) the whole world meets, before
    the schedule's first collective (:func:`pipeline_forwards`): every rank runs a part of it.
    Collective on every rank (it may create a gloo group beside an NCCL shard group, and one
    over the world for stages); idempotent. The Trainer's strategy calls it at setup."""
    roots = [r for r in sharded_roots(module) if state_of(r).schedule.peer_check is None]
    if any(is_stage(r) for r in roots):  # every rank holds stages: all create the world's group alike
        world = PeerCheck(world_host_group(), list(range(dist.get_world_size())), pipelined=True)
        for root in roots:
            state_of(root).schedule.peer_check = world
        return
    for root in roots:
        st = state_of(root)
        st.schedule.peer_check = PeerCheck(host_group(st.sg), list(st.sg.global_ranks))


@contextmanager
def pipeline_forwards(stages: Iterable[nn.Module]) -> Iterator[None]:
    """Around a pipelined model's schedule (``forward_loss``, ``forward_outputs``): outside a
    training loop's steps the stages' lone-forward check (the world's, :func:`watch_lone_forwards`)
    runs first, before the batch check's all-gather; inside, the stages' forwards run as scheduled
    (every rank came). Without a watch (Fabric) nothing is checked."""
    states = [state_of(s) for s in stages]
    if states:
        states[0].schedule.check_peers()  # the same check on every stage: once is enough
    with ExitStack() as stack:
        for st in states:
            stack.enter_context(st.schedule.scheduled())
        yield


@contextmanager
def scheduled_forwards(module: nn.Module) -> Iterator[None]:
    """Forwards inside are a training loop's steps, which every rank runs: no lone-forward check."""
    with ExitStack() as stack:
        for root in sharded_roots(module):
            stack.enter_context(state_of(root).schedule.scheduled())
        yield


def is_sharded_root(module: nn.Module) -> bool:
    """True if ``matrix_shard`` sharded exactly ``module`` (not only a module inside it)."""
    return state_of(module) is not None


@dataclass(frozen=True)
class NormGroups:
    """Where a global norm of a sharded model's gradients is summed, and where it is counted."""

    #: the owners' pieces: the shard group (HSDP replicas hold equal gradients), or the world
    #: (None) under ``replica_split`` (one rank holds each gradient)
    group: Optional[dist.ProcessGroup]
    #: the tensor-parallel group (None without tensor parallelism) and its size
    tp_group: Optional[dist.ProcessGroup]
    tp_size: int
    #: the model's traffic counters (the all-reduces count under ``clip``)
    stats: CommStats


def norm_groups(module: nn.Module) -> Optional[NormGroups]:
    """The ``NormGroups`` of ``module`` or of the first sharded model inside it (None: none is)."""
    st = find_state(module)
    if st is None:
        return None
    return NormGroups(st.norm_group, st.mesh.tp_group, st.mesh.tp_size, st.stats)


def tp_group_of(params: Iterable[Any]) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group of the first TP-split parameter in ``params`` (None: no
    parameter is a TP fragment). Every TP rank's fragment carries it, on every rank alike."""
    for p in params:
        fragment = tp_of(p)
        if fragment is not None:
            return fragment.tp.group
    return None


def row_span(module: nn.Module, p: Any) -> Optional[tuple[int, int, int]]:
    """For a parameter of a sharded model inside ``module``: ``(start, rows, whole)``, the rows
    (dim 0) of the whole tensor that this rank's tensor-parallel fragment covers, and the whole
    tensor's rows; every row where tensor parallelism does not split dim 0. Whether this rank
    holds the fragment's data (its owner) is the resident tensor's own size. None where ``p`` is
    no resident parameter of a sharded model. Local."""
    for root in sharded_roots(module):
        st = state_of(root)
        for sp in st.params:
            if sp.resident is not p:
                continue
            layout = st.tp_plan.layouts.get(sp.shard.fqn) if st.tp_plan is not None else None
            if layout is None:
                return 0, int(sp.shard.shape[0]), int(sp.shard.shape[0])
            whole = int(layout.global_shape[0])
            if layout.dim == 0 and layout.split:
                r = st.mesh.tp_rank
                return layout.offset(r), layout.sizes[r], whole
            return 0, whole, whole
    return None


def release_unfinished(module: nn.Module) -> None:
    """Release what a forward without backward left materialized in every sharded model inside
    ``module`` (``StochasticWeightAveraging``'s BatchNorm epoch skips backward). Local."""
    for root in sharded_roots(module):
        state_of(root).release_unfinished()


def wait_replicas(module: nn.Module) -> None:
    """``replica_split``: finish the weight transfers in flight of every sharded model inside
    ``module``, pipeline stages included (local). No-op without ``replica_split``."""
    for root in sharded_roots(module):
        state_of(root).wait_replicas()


def settle_replicas(module: nn.Module) -> None:
    """``replica_split``: every replica of every sharded model inside ``module`` holds the current
    weights and nothing is left to send (the weights sent are not sent again), so an evaluation
    forward, which some ranks may skip under the uneven-inputs join, sends nothing. Collective
    over the replicas. No-op without ``replica_split``."""
    for root in sharded_roots(module):
        state_of(root).settle_replicas(clear=True)


def follow_requires_grad(module: nn.Module) -> None:
    """After ``requires_grad`` of resident parameters changed (``toggle_optimizer``): the unsharded
    parameters of every sharded model inside ``module`` follow now, also in a unit that is
    materialized (the root, during a training step), so that a frozen parameter gets no gradient
    in the backward that follows, as under DDP. Local."""
    for root in sharded_roots(module):
        state_of(root).follow_requires_grad()


def skip_buffer_broadcast(module: nn.Module) -> None:
    """The next forward of every sharded model inside ``module`` keeps each rank's buffers, as
    DDP's after a forward it ran with the gradient sync marked off: Lightning marks every
    manual-optimization training step so (its backward is the user's). Local."""
    for root in sharded_roots(module):
        state_of(root).skip_buffer_broadcast()


def broadcast_buffers(module: nn.Module, only_if_due: bool = False) -> None:
    """Every sharded model inside ``module`` takes global rank 0's buffers (collective; nothing
    with ``broadcast_buffers=False``). ``only_if_due``: only where DDP's next forward would."""
    for root in sharded_roots(module):
        state_of(root).broadcast_buffers(only_if_due)
