"""Placement metadata: who owns what, and the owner-segment layout of each unit.

Pure Python (no process group), so plans can be built, compared, printed and
stored without a distributed job.  A plan is a deterministic function of the
model's parameter list, the shard span and the planner options.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterable, Optional, Sequence

from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
from lightning_matrixfsdp.runtime.plan_text import plan_text


class RoleKind(str, Enum):
    """What gets an owner: one 2D matrix, or the packed non-matrix tail of a unit."""

    MATRIX = "matrix"
    TAIL = "tail"


_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Element size of a dtype given by name (``"float32"``, ``"torch.bfloat16"``)."""
    return _DTYPE_BYTES[dtype.replace("torch.", "")]


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _Sized:
    """``numel`` / ``nbytes`` of anything with a ``shape`` and a ``dtype`` name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class ParamSpec(_Sized):
    """What the planner needs to know of one parameter (no tensors)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    is_matrix: bool
    requires_grad: bool = True
    #: an expert stack (a matrix role stepped as ``stack.num_experts`` matrices), or None
    stack: Optional[ExpertStack] = None
    #: a matrix role the Muon recipe steps with AdamW (an embedding, the head): priced as AdamW
    recipe_adamw: bool = False


@dataclass(frozen=True)
class UnitSpec:
    """One unit's parameters in registration order; ``fqn`` is ``""`` for the root."""

    fqn: str
    params: tuple[ParamSpec, ...]


@dataclass(frozen=True)
class MatrixShard(_Sized):
    """Placement of one parameter: its role, its owner, and its owner segment slot.

    ``segment_offset`` is the element offset of the parameter inside its owner's
    segment of the unit (owned parameters concatenated in unit order), the layout
    that the padded all-gather implementation uses.

    ``experts``: a *split* expert stack's block ``[start, stop)`` of experts, which this entry's
    owner holds (one entry per block, in expert order; ``shape`` stays the whole stack's, while
    ``numel``/``nbytes`` are the block's: what the owner's segment holds). None: the whole parameter.
    """

    fqn: str
    unit: str
    shape: tuple[int, ...]
    dtype: str
    role: RoleKind
    owner: int
    segment_offset: int
    requires_grad: bool = True
    #: the expert-stack declaration of a stacked matrix role (None: an ordinary parameter)
    stack: Optional[ExpertStack] = None
    #: a split stack's block of experts ``(start, stop)`` held by ``owner`` (None: the whole tensor)
    experts: Optional[tuple[int, int]] = None

    @property
    def numel(self) -> int:
        """Elements this entry's owner holds: the block of a split stack, else the whole tensor."""
        if self.experts is None:
            return numel_of(self.shape)
        return (self.experts[1] - self.experts[0]) * numel_of(self.shape[1:])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of what the owner holds (a split stack's block, else the whole shape)."""
        if self.experts is None:
            return tuple(self.shape)
        return (self.experts[1] - self.experts[0], *self.shape[1:])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["role"] = self.role.value
        d.pop("stack")
        d.pop("experts")
        if self.stack is not None:  # absent otherwise, so the layouts (and digests) of earlier plans stay valid
            d["stack"] = self.stack.to_dict()
        if self.experts is not None:  # likewise: only a split stack's blocks carry their expert range
            d["experts"] = list(self.experts)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "MatrixShard":
        return MatrixShard(
            fqn=d["fqn"], unit=d["unit"], shape=tuple(d["shape"]), dtype=d["dtype"],
            role=RoleKind(d["role"]), owner=int(d["owner"]),
            segment_offset=int(d["segment_offset"]), requires_grad=bool(d["requires_grad"]),
            stack=ExpertStack.from_dict(d["stack"]) if d.get("stack") else None,
            experts=(int(d["experts"][0]), int(d["experts"][1])) if d.get("experts") else None,
        )


@dataclass(frozen=True)
class UnitLayout:
    """The owner-segment layout of one unit over a shard span of ``world`` ranks."""

    fqn: str
    world: int
    shards: tuple[MatrixShard, ...]

    def segment_numel(self, rank: int) -> int:
        return sum(s.numel for s in self.shards if s.owner == rank)

    @property
    def max_segment_numel(self) -> int:
        return max((self.segment_numel(r) for r in range(self.world)), default=0)

    def owned_bytes(self, rank: int) -> int:
        return sum(s.nbytes for s in self.shards if s.owner == rank)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def gamma(self) -> float:
        """Busiest owner's bytes over the even share: 1.0 is FSDP-balanced."""
        total = self.nbytes
        if total == 0:
            return 1.0
        return max(self.owned_bytes(r) for r in range(self.world)) / (total / self.world)

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "world": self.world, "shards": [s.to_dict() for s in self.shards]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "UnitLayout":
        return UnitLayout(d["fqn"], int(d["world"]), tuple(MatrixShard.from_dict(s) for s in d["shards"]))


@dataclass
class PlanNote:
    """What one parallel style adds to a plan outside its roles: figures every shard rank holds on
    top of its roles (the same on every rank: expert parallelism's local experts) and the lines the
    printout shows for it."""

    #: which style (``"tensor_parallel"``, ``"expert_parallel"``)
    style: str
    lines: tuple[str, ...] = ()
    param_bytes: int = 0
    resident_bytes: int = 0
    flops: int = 0
    matrices: int = 0


@dataclass
class Plan:
    """The planner's output for the whole model.

    ``loads_bytes`` / ``loads_flops`` are per-rank resident bytes (params, grads and
    optimizer state) and optimizer FLOPs per step as the cost model estimates them.

    ``steppers`` (``replica_split`` under HSDP, else empty): parameter fqn -> the replica
    that steps its role and alone holds its optimizer state; ``replica_flops[k][r]``:
    optimizer FLOPs per step of shard rank ``r`` in replica ``k`` under that assignment.

    ``options``: the planner's and the runtime's choices (``collective`` and why, ...).
    ``notes``: what each parallel style adds outside the roles (:class:`PlanNote`: expert
    parallelism's local experts, the TP steppers), and ``roles``: the classification rows
    (``classify.describe_roles``); the printout reads them, the digest and ``to_dict`` do not.
    """

    world: int
    planner: str
    units: list[UnitLayout]
    loads_bytes: list[int]
    loads_flops: list[int]
    replicate: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    steppers: dict[str, int] = field(default_factory=dict)
    replica_flops: list[list[int]] = field(default_factory=list)
    notes: list["PlanNote"] = field(default_factory=list, repr=False, compare=False)
    roles: list[tuple] = field(default_factory=list, repr=False, compare=False)

    # ------------------------------------------------------------------ queries
    def shards(self) -> Iterable[MatrixShard]:
        for u in self.units:
            yield from u.shards

    @property
    def owners(self) -> dict[str, int]:
        """fqn -> owner rank; a split expert stack's is the owner of its first block (all of them:
        :meth:`pieces`)."""
        out: dict[str, int] = {}
        for s in self.shards():
            out.setdefault(s.fqn, s.owner)
        return out

    def shard(self, fqn: str) -> MatrixShard:
        """The placement of ``fqn`` (a split expert stack: its first block; all of them: :meth:`pieces`)."""
        for s in self.shards():
            if s.fqn == fqn:
                return s
        raise KeyError(fqn)

    def pieces(self, fqn: str) -> tuple[MatrixShard, ...]:
        """Every entry of ``fqn``: one for a whole parameter, one per expert block of a split stack."""
        out = tuple(s for s in self.shards() if s.fqn == fqn)
        if not out:
            raise KeyError(fqn)
        return out

    @property
    def split_stacks(self) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """fqn -> ((start, stop, owner), ...) of every expert stack split into blocks, in plan order."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for s in self.shards():
            if s.experts is not None:
                out.setdefault(s.fqn, []).append((s.experts[0], s.experts[1], s.owner))
        return {k: tuple(v) for k, v in out.items()}

    @property
    def replica_split(self) -> bool:
        """Whether each role is stepped by one replica only (``steppers`` set)."""
        return bool(self.steppers)

    def stepper(self, fqn: str) -> Optional[int]:
        """The replica that steps ``fqn``'s role; None without ``replica_split`` (every replica)."""
        return self.steppers.get(fqn) if self.steppers else None

    # Expert parallelism's local experts are outside the roles; its note says what each rank holds of
    # them (the same on every rank), added to each rank's figures.
    def param_bytes(self, rank: int) -> int:
        """Parameter bytes shard rank ``rank`` holds between steps: the roles it owns (a split stack's
        block), plus what the notes add (local experts under expert parallelism)."""
        return sum(u.owned_bytes(rank) for u in self.units) + sum(n.param_bytes for n in self.notes)

    def resident_bytes(self, rank: int) -> int:
        """The cost model's resident bytes of shard rank ``rank`` (parameters, gradients, optimizer
        state): its roles' load plus the notes' (local experts)."""
        return self.loads_bytes[rank] + sum(n.resident_bytes for n in self.notes)

    def optimizer_flops(self, rank: int) -> int:
        """Optimizer FLOPs per step of shard rank ``rank``: its roles' plus the notes' (local experts)."""
        return self.loads_flops[rank] + sum(n.flops for n in self.notes)

    def matrices(self, rank: int) -> int:
        """Matrices shard rank ``rank`` steps: the matrix roles it owns plus the notes' (local experts)."""
        return sum(1 for s in self.shards() if s.role == RoleKind.MATRIX and s.owner == rank) + sum(
            n.matrices for n in self.notes)

    @property
    def memory_imbalance(self) -> float:
        return _imbalance([self.resident_bytes(r) for r in range(self.world)])

    @property
    def compute_imbalance(self) -> float:
        return _imbalance([self.optimizer_flops(r) for r in range(self.world)])

    @property
    def gammas(self) -> dict[str, float]:
        return {u.fqn: u.gamma for u in self.units}

    @property
    def max_gamma(self) -> float:
        return max((u.gamma for u in self.units), default=1.0)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "replicate": self.replicate,
            "planner": self.planner,
            "options": dict(self.options),
            "units": [u.to_dict() for u in self.units],
            "loads_bytes": list(self.loads_bytes),
            "loads_flops": list(self.loads_flops),
            "memory_imbalance": self.memory_imbalance,
            "compute_imbalance": self.compute_imbalance,
            "gamma": self.gammas,
            **({"steppers": dict(self.steppers), "replica_flops": [list(r) for r in self.replica_flops]}
               if self.steppers else {}),
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        return Plan(
            world=int(d["world"]), planner=d["planner"],
            units=[UnitLayout.from_dict(u) for u in d["units"]],
            loads_bytes=[int(x) for x in d["loads_bytes"]],
            loads_flops=[int(x) for x in d["loads_flops"]],
            replicate=int(d.get("replicate", 1)), options=dict(d.get("options", {})),
            steppers={str(k): int(v) for k, v in (d.get("steppers") or {}).items()},
            replica_flops=[[int(x) for x in r] for r in (d.get("replica_flops") or [])],
        )

    @staticmethod
    def from_json(s: str) -> "Plan":
        return Plan.from_dict(json.loads(s))

    def digest(self) -> str:
        """A short hash of the placement (not of the printed figures)."""
        core: dict[str, Any] = {"world": self.world, "replicate": self.replicate,
                                "units": [u.to_dict() for u in self.units]}
        if self.steppers:  # absent without replica_split, so earlier digests stay valid
            core["steppers"] = self.steppers
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ display
    def __str__(self) -> str:
        return plan_text(self)


def _imbalance(loads: Sequence[int]) -> float:
    if not loads or sum(loads) == 0:
        return 1.0
    return max(loads) / (sum(loads) / len(loads))


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Name the first unit/parameter where two plan dicts disagree (for error messages)."""
    if a.get("world") != b.get("world"):
        return f"shard span {a.get('world')} vs {b.get('world')}"
    ua, ub = a.get("units", []), b.get("units", [])
    for i in range(max(len(ua), len(ub))):
        if i >= len(ua) or i >= len(ub):
            extra = (ua if len(ua) > len(ub) else ub)[i]["fqn"]
            return f"unit count {len(ua)} vs {len(ub)} (first extra unit {extra!r})"
        x, y = ua[i], ub[i]
        if x["fqn"] != y["fqn"]:
            return f"unit #{i}: {x['fqn']!r} vs {y['fqn']!r}"
        sx, sy = x["shards"], y["shards"]
        for j in range(max(len(sx), len(sy))):
            if j >= len(sx) or j >= len(sy):
                return f"unit {x['fqn']!r}: parameter count {len(sx)} vs {len(sy)}"
            if sx[j] != sy[j]:
                p, q = sx[j], sy[j]
                diffs = [k for k in p if p.get(k) != q.get(k)]
                return (f"unit {x['fqn']!r}, parameter {p['fqn']!r}: "
                        + ", ".join(f"{k} {p.get(k)!r} vs {q.get(k)!r}" for k in diffs))
    sa, sb = a.get("steppers") or {}, b.get("steppers") or {}
    if sa != sb:
        for k in sorted(set(sa) | set(sb)):
            if sa.get(k) != sb.get(k):
                return f"parameter {k!r}: stepping replica {sa.get(k)!r} vs {sb.get(k)!r} (replica_split)"
    return "collective schedule or options differ"
