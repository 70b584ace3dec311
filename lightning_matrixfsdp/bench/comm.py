"""Count the bytes every collective moves, per rank and per phase, for any mode.

Why a dispatch mode: every eager collective in PyTorch, whether called through
`torch.distributed` (FSDP2, DDP's reducer, our runtime, send/recv) or through
DTensor's functional collectives (inside `torch.optim.Muon` on DTensor
parameters), reaches the dispatcher as an op in the `c10d` or
`_c10d_functional` namespace. One `TorchDispatchMode` therefore sees them all,
independently of which Python wrapper a given torch version uses, without
monkey-patching. DTensor ops are passed through (`NotImplemented`) so DTensor
desugars them first and we see the collectives it issues.

Per-rank byte convention (the one of the analytic model in `scaling.py` and of
docs/how-it-works.md#bandwidth; `T` is the byte size of the tensor argument, `W` the
group size):

| collective | sent by a rank | received by a rank |
| --- | --- | --- |
| all-gather (input `T` per rank) | `(W-1) T` | `(W-1) T` (ring: `(W-1)/W` of the output) |
| reduce-scatter (input `T`) | `(W-1)/W T` | `(W-1)/W T` |
| all-reduce (`T`) | `2 (W-1)/W T` | `2 (W-1)/W T` (ring) |
| broadcast (`T`) | root: `T`, others 0 | root 0, others `T` |
| reduce (`T`) | non-root: `T`, root 0 | root: `T`, others 0 (pipelined chain) |
| gather (`T` per rank) | non-root `T` | root `(W-1) T` |
| scatter (`T` per rank) | root `(W-1) T` | non-root `T` |
| all-to-all | everything but the own chunk | everything but the own chunk |
| send / recv | `T` / 0 | 0 / `T` |

torch.compile refuses to run under a non-infra dispatch mode, so wrap counted
code in `torch.compiler.set_stance("force_eager")` (the runner does).

Broadcast and reduce count the logical payload each rank injects or needs; a
ring or tree implementation also forwards up to `T` through intermediate ranks,
which is not counted. Barriers count calls only. Collectives we do not know
are counted as calls under their op name with zero bytes, so gaps are visible.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_IGNORED = {"wait_tensor", "_wrap_tensor_autograd"}


def tensor_bytes(x: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Dispatch mode that accumulates per-phase {sent, recv, calls} for this rank.

    Set `counter.phase` between phases; read `counter.totals()` afterwards.
    Groups seen only by name (functional collectives) are resolved through
    `register_group`; unknown names fall back to the default world group.
    """

    def __init__(self, groups: Sequence[dist.ProcessGroup] = ()) -> None:
        super().__init__()
        self.phase = "unphased"
        # phase -> op -> [sent, recv, calls]
        self.records: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
        self._names: dict[str, tuple[int, int]] = {}
        if dist.is_initialized():
            self.register_group(dist.group.WORLD)
        for g in groups:
            self.register_group(g)

    # ----------------------------------------------------------------- groups
    def register_group(self, group: dist.ProcessGroup | None) -> None:
        """Remember (rank, size) of a group by its name for functional collectives."""
        if group is None:
            return
        try:
            self._names[str(group.group_name)] = (group.rank(), group.size())
        except Exception:  # pragma: no cover - exotic groups
            pass

    def _world(self) -> tuple[int, int]:
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _pg(self, obj: Any) -> tuple[int, int]:
        """(rank, size) of a process-group argument: a boxed ProcessGroup or a name."""
        if isinstance(obj, str):
            return self._names.get(obj, self._world())
        if isinstance(obj, dist.ProcessGroup):
            self.register_group(obj)
            return obj.rank(), obj.size()
        try:
            pg = dist.ProcessGroup.unbox(obj)
            self.register_group(pg)
            return pg.rank(), pg.size()
        except Exception:
            return self._world()

    # ------------------------------------------------------------- accounting
    def _add(self, op: str, sent: float, recv: float) -> None:
        rec = self.records[self.phase][op]
        rec[0] += int(round(sent))
        rec[1] += int(round(recv))
        rec[2] += 1

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:  # noqa: C901 - one table
        a = args
        if name in _IGNORED:
            return
        # ---- c10d (ProcessGroup) ops: group is a boxed ProcessGroup argument.
        if name == "_allgather_base_":
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[1])
            return self._add(name, (w - 1) * t, (w - 1) * t)
        if name in ("allgather_", "allgather_coalesced_"):
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[1])
            return self._add(name, (w - 1) * t, max(tensor_bytes(a[0]) - t, 0))
        if name == "allgather_into_tensor_coalesced_":
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[1])
            return self._add(name, (w - 1) * t, (w - 1) * t)
        if name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[0])  # output = one shard
            return self._add(name, (w - 1) * t, (w - 1) * t)
        if name in ("allreduce_", "allreduce_coalesced_"):
            rank, w = self._pg(a[1])
            t = tensor_bytes(a[0])
            return self._add(name, 2 * (w - 1) / w * t, 2 * (w - 1) / w * t)
        if name == "broadcast_":
            rank, w = self._pg(a[1])
            t = tensor_bytes(a[0])
            root = a[2]
            return self._add(name, t if rank == root else 0, 0 if rank == root else t)
        if name == "reduce_":
            rank, w = self._pg(a[1])
            t = tensor_bytes(a[0])
            root = a[3]
            return self._add(name, 0 if rank == root else t, t if rank == root else 0)
        if name == "send":
            return self._add(name, tensor_bytes(a[0]), 0)
        if name in ("recv_", "recv_any_source_"):
            return self._add(name, 0, tensor_bytes(a[0]))
        if name == "gather_":
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[1])
            root = a[3]
            return self._add(name, 0 if rank == root else t, (w - 1) * t if rank == root else 0)
        if name == "scatter_":
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[0])
            root = a[3]
            return self._add(name, (w - 1) * t if rank == root else 0, 0 if rank == root else t)
        if name == "alltoall_base_":
            rank, w = self._pg(a[2])
            out, inp, out_splits, in_splits = a[0], a[1], list(a[3]), list(a[4])
            return self._add(name, _a2a_other(inp, in_splits, rank, w), _a2a_other(out, out_splits, rank, w))
        if name == "alltoall_":
            rank, w = self._pg(a[2])
            outs, ins = list(a[0]), list(a[1])
            sent = tensor_bytes(ins) - (tensor_bytes(ins[rank]) if rank < len(ins) else 0)
            recv = tensor_bytes(outs) - (tensor_bytes(outs[rank]) if rank < len(outs) else 0)
            return self._add(name, sent, recv)
        if name in ("barrier", "monitored_barrier_"):
            return self._add(name, 0, 0)
        # ---- functional collectives: group given by name (and size).
        if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
            w = int(a[1])
            t = tensor_bytes(a[0])
            return self._add("funcol." + name, (w - 1) * t, (w - 1) * t)
        if name == "all_gather_into_tensor_coalesced":
            w = int(a[1])
            t = tensor_bytes(a[0])
            return self._add("funcol." + name, (w - 1) * t, (w - 1) * t)
        if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
            w = int(a[2])
            t = tensor_bytes(a[0])
            return self._add("funcol." + name, (w - 1) / w * t, (w - 1) / w * t)
        if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[0])
            return self._add("funcol." + name, 2 * (w - 1) / w * t, 2 * (w - 1) / w * t)
        if name in ("broadcast", "broadcast_") and len(a) == 3:
            rank, w = self._pg(a[2])
            t = tensor_bytes(a[0])
            root = int(a[1])
            return self._add("funcol." + name, t if rank == root else 0, 0 if rank == root else t)
        if name == "all_to_all_single":
            rank, w = self._pg(a[3])
            inp = a[0]
            out_splits, in_splits = list(a[1]), list(a[2])
            sent = _a2a_other(inp, in_splits, rank, w)
            row = inp.numel() // max(inp.shape[0], 1) * inp.element_size() if inp.ndim else inp.element_size()
            recv = (sum(out_splits) - (out_splits[rank] if rank < len(out_splits) else 0)) * row if out_splits else sent
            return self._add("funcol." + name, sent, recv)
        if name == "isend":
            return self._add("funcol." + name, tensor_bytes(a[0]), 0)
        if name == "irecv":
            return self._add("funcol." + name, 0, tensor_bytes(a[0]))
        if name == "batch_p2p_ops":
            ops, tensors = list(a[0]), list(a[3])
            sent = sum(tensor_bytes(t) for o, t in zip(ops, tensors) if "send" in o)
            recv = sum(tensor_bytes(t) for o, t in zip(ops, tensors) if "recv" in o)
            return self._add("funcol." + name, sent, recv)
        self._add("unknown." + name, 0, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Let tensor subclasses (DTensor) desugar first; their collectives come back to us.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if getattr(func, "namespace", None) in _NAMESPACES:
            self._count(func._overloadpacket.__name__, args, kwargs)
        return func(*args, **kwargs)

    # ---------------------------------------------------------------- results
    def totals(self) -> dict[str, dict[str, Any]]:
        """{phase: {"sent": bytes, "recv": bytes, "calls": n, "ops": {op: {...}}}} for this rank."""
        out: dict[str, dict[str, Any]] = {}
        for phase, ops in self.records.items():
            out[phase] = {
                "sent": sum(v[0] for v in ops.values()),
                "recv": sum(v[1] for v in ops.values()),
                "calls": sum(v[2] for v in ops.values()),
                "ops": {op: {"sent": v[0], "recv": v[1], "calls": v[2]} for op, v in sorted(ops.items())},
            }
        return out

    def reset(self) -> None:
        self.records.clear()


def _a2a_other(t: torch.Tensor, splits: list[int], rank: int, w: int) -> int:
    """Bytes of `t` outside this rank's own chunk (dim 0 splits, or equal chunks)."""
    total = tensor_bytes(t)
    if not splits:
        return total - total // max(w, 1)
    rows = max(sum(splits), 1)
    return total - (total * splits[rank] // rows if rank < len(splits) else 0)


@contextlib.contextmanager
def count_comm(groups: Sequence[dist.ProcessGroup] = ()) -> Iterator[CommCounter]:
    """`with count_comm() as c: c.phase = "forward"; ...` then `c.totals()`."""
    counter = CommCounter(groups)
    with counter:
        yield counter
