"""Tensor parallelism: how one parameter is split over the TP group (``TPLayout``), pure.

After ``parallelize_module`` a parameter is a DTensor on the TP mesh: ``Shard(0)`` (colwise),
``Shard(1)`` (rowwise) or ``Replicate()``. Owner sharding then works on each TP rank's local
fragment over the data-parallel group; this file reads the split, refuses what the runtime
cannot serve (before any communication), and gives every fragment's size along the split
dimension, so each rank knows the others' fragments without asking; and a fragment as a DTensor
over the same storage (:func:`as_dtensor`, :func:`fragment_dtensor`: what a unit registers in
forward, what a checkpoint hands DCP). Nothing here communicates (``tp/step_comm.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["TPLayout", "as_dtensor", "chunk_sizes", "fragment_dtensor", "read_layout"]


def chunk_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``torch.chunk(range(n), parts)`` padded with empty fragments: DTensor's ``Shard``."""
    step = -(-n // parts) if n else 0
    return tuple(max(0, min(step, n - i * step)) for i in range(parts))


@dataclass(frozen=True)
class TPLayout:
    """One parameter's split over the TP group: ``dim`` (None: replicated on every TP rank),
    the whole tensor's shape, and every TP rank's fragment size along ``dim``."""

    fqn: str
    dim: Optional[int]
    global_shape: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def split(self) -> bool:
        """True when the TP ranks hold different fragments (not replicated)."""
        return self.dim is not None and len(self.sizes) > 1

    def local_shape(self, tp_rank: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = self.sizes[tp_rank]
        return tuple(shape)

    def offset(self, tp_rank: int) -> int:
        """Where TP rank ``tp_rank``'s fragment starts along ``dim``."""
        return sum(self.sizes[:tp_rank])

    def describe(self) -> str:
        return "Replicate()" if self.dim is None else f"Shard({self.dim})"

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "global_shape": list(self.global_shape), "sizes": list(self.sizes)}


def read_layout(fqn: str, p: Any, tp_mesh: Any, tp_size: int, is_matrix: bool) -> TPLayout:
    """The layout of parameter ``p`` (a DTensor on ``tp_mesh``, or a plain tensor: replicated).

    Refuses, naming the parameter and the fix: a DTensor on another mesh (2-D or FSDP2
    placements), ``Partial``, strided shards (``_StridedShard``), a shard along a dimension the
    whole-matrix step cannot stitch (a matrix split other than along rows or columns)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return TPLayout(fqn, None, tuple(p.shape), (int(p.shape[0]) if p.ndim else 1,) * tp_size)
    mesh = p.device_mesh
    if mesh.ndim != 1 or tp_mesh is None or mesh.mesh.flatten().tolist() != tp_mesh.mesh.flatten().tolist():
        raise MatrixShardError(
            f"parameter {fqn!r} is a DTensor on the mesh {mesh} with placements {p.placements}; matrix_fsdp "
            "takes DTensors placed on the tensor-parallel mesh only (1-D, device_mesh['tensor_parallel']): apply "
            "parallelize_module(..., self.device_mesh['tensor_parallel'], plan) and no fully_shard")
    (placement,) = p.placements
    shape = tuple(int(s) for s in p.shape)
    if isinstance(placement, Replicate):
        return TPLayout(fqn, None, shape, (shape[0] if shape else 1,) * tp_size)
    if type(placement) is not Shard:  # Partial, _StridedShard, anything newer
        raise MatrixShardError(
            f"parameter {fqn!r} has the tensor-parallel placement {placement!r}; matrix_fsdp accepts Shard(0), "
            "Shard(1) and Replicate() parameters (Partial parameters hold unreduced sums, strided shards come from "
            "composing two splits of one dimension): change the parallelize plan")
    dim = placement.dim % len(shape)
    if is_matrix and dim > 1:
        raise MatrixShardError(f"parameter {fqn!r} is split along dim {dim}; a matrix can be split along rows "
                               "(Shard(0), colwise) or columns (Shard(1), rowwise) only")
    sizes = chunk_sizes(shape[dim], tp_size)
    if is_matrix and min(sizes) == 0:
        raise MatrixShardError(f"parameter {fqn!r}: {shape[dim]} along dim {dim} split over {tp_size} TP ranks leaves "
                               f"some of them an empty fragment ({list(sizes)}); split it over fewer ranks or keep it "
                               "replicated")
    local = tuple(p.to_local().shape)
    rank = mesh.get_local_rank()
    expected = list(shape)
    expected[dim] = sizes[rank]
    if local != tuple(expected):
        raise MatrixShardError(
            f"parameter {fqn!r}: TP rank {rank} holds a fragment of shape {local}, not {tuple(expected)} as "
            "Shard's even chunks would give; matrix_fsdp needs DTensor's own split (distribute_tensor / "
            "parallelize_module), not from_local with custom sizes")
    return TPLayout(fqn, dim, shape, sizes)


def local_data(p: Any) -> torch.Tensor:
    """The plain tensor a parameter holds on this rank (a DTensor's local fragment)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def as_dtensor(local: torch.Tensor, spec: tuple[Any, tuple, torch.Size, tuple[int, ...]]) -> torch.Tensor:
    """The DTensor over ``local`` (same storage) with ``spec`` = (TP mesh, placements, global shape,
    global stride): what a unit registers in forward, as ``parallelize_module`` placed it."""
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    with torch.no_grad():
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def fragment_dtensor(local: torch.Tensor, mesh: Any, dim: int, shape: Sequence[int]) -> torch.Tensor:
    """``local`` (same storage) as TP fragment ``Shard(dim)`` of a contiguous tensor of global
    ``shape``: how checkpoints hand a fragment to DCP (one chunk of the global tensor)."""
    from torch.distributed.tensor import Shard

    shape = torch.Size(shape)
    return as_dtensor(local, (mesh, (Shard(dim),), shape, torch.empty(shape, device="meta").stride()))
