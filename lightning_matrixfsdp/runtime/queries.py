"""Questions about a sharded model: its plan, its traffic, the no-sync switch, the
``replica_split`` weight transfers (start, and wait until the replicas are equal), and
which forwards a training loop schedules on every rank (the lone-forward check)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

from torch import nn

from lightning_matrixfsdp.runtime.consensus import PeerCheck, host_group
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.tags import find_state, sharded_roots, state_of


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
    replicas: call it on every rank. No-op without ``replica_split``."""
    _state(module).settle_replicas()


def watch_lone_forwards(module: nn.Module) -> None:
    """From now on, a forward of each sharded model inside ``module`` that does not run
    inside :func:`scheduled_forwards` first meets the other ranks of its shard group, and
    raises ``LoneForwardError`` if they do not come within seconds (``consensus.PeerCheck``).
    Collective on every rank (it may create a gloo group beside an NCCL shard group);
    idempotent. The Trainer's strategy calls it at setup."""
    for root in sharded_roots(module):
        st = state_of(root)
        if st.schedule.peer_check is None:
            st.schedule.peer_check = PeerCheck(host_group(st.sg), list(st.sg.global_ranks))


@contextmanager
def scheduled_forwards(module: nn.Module) -> Iterator[None]:
    """Forwards inside are a training loop's steps, which every rank runs: no lone-forward check."""
    with ExitStack() as stack:
        for root in sharded_roots(module):
            stack.enter_context(state_of(root).schedule.scheduled())
        yield
