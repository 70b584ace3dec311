"""Questions about a sharded model: its plan, its traffic, and the no-sync switch."""

from __future__ import annotations

from torch import nn

from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.tags import find_state


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
