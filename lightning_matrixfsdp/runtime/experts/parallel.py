"""Expert parallelism (``expert_parallel_size=EP``): experts stay on their rank, tokens move.

:func:`prepare_experts` runs in ``matrix_shard`` before the units are collected: it finds the
experts modules (``experts/seams.py``), refuses what cannot work (on every rank, from one
agreement gathered before any other collective), takes the groups built from the mesh record
(``mesh/comm.py``),
marks each stacked parameter with this rank's :class:`ExpertSlice` (marked parameters enter
no unit: they are never materialized and never reduced to an owner) and installs the
dispatching forward. Once the roles are known, :meth:`ExpertParallel.split` keeps on each rank
its ``E/EP`` experts of global rank 0's stacks as a *local* parameter ``[E/EP, ...]`` (the
same ``nn.Parameter`` object). A stack built on the meta device has no rank 0 value yet: it is
replaced there by a new parameter of this rank's uninitialized experts, which the model's
meta-device initialization fills as one process would (``meta_init.py``: the whole stack
initialized once, rank 0's experts sent to every rank).

:class:`ExpertParallel` is their gradient's way to DDP's mean: backward accumulates each
rank's local gradient aside (a hook on the parameter), and the end-of-backward flush sums it
over the ranks holding the same experts and divides by the whole data-parallel size, into
``.grad``. The token all-to-all's backward already added, on each expert's rank, the
contributions of every rank of its expert-parallel group; the replica sum adds the other
groups'. So an expert's gradient is the sum over every token routed to it, divided by the
data-parallel size, whatever EP is. An expert that received no token anywhere gets a zero
gradient (never ``None``: every rank issues the same sums), which the optimizer steps as any
zero gradient. ``optimizer.step()`` communicates nothing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.comm.core import CommStats
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.comm import ExpertGroups, expert_mesh, rank0_slices, start_replica_sum
from lightning_matrixfsdp.runtime.experts.dispatch import expert_parallel_forward, hf_experts_forward
from lightning_matrixfsdp.runtime.experts.seams import ExpertSeam, find_seams, install_forward
from lightning_matrixfsdp.runtime.experts.stats import RoutingCounts
from lightning_matrixfsdp.runtime.mesh.comm import dims_of, expert_groups
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.placement import ParamSpec, PlanNote, RoleKind
from lightning_matrixfsdp.runtime.roles import role_cost
from lightning_matrixfsdp.runtime.comm.small import gather_objects
from lightning_matrixfsdp.runtime.tags import expert_slice_of, stack_of, tag_expert_slice, tag_stack

__all__ = ["ExpertParallel", "ExpertSlice", "prepare_experts"]


@dataclass(frozen=True, eq=False)
class ExpertSlice:
    """This rank's experts ``[first, first + count)`` of the stack ``fqn`` (whole shape ``global_shape``)."""

    fqn: str
    global_shape: tuple[int, ...]
    first: int
    count: int
    groups: ExpertGroups
    #: built on the meta device: initialized with the model's other meta-device modules (``meta_init``:
    #: the whole stack once, rank 0's experts to every rank), not taken from rank 0's tensor
    from_meta: bool = False

    @property
    def num_experts(self) -> int:
        return self.global_shape[0]

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def first_replica(self) -> bool:
        """Whether this rank is in the first expert-parallel group: the one whose copy of each
        expert counts in global norms and is written to checkpoints (the others hold equal copies)."""
        return self.groups.replica_rank == 0


class ExpertParallel:
    """The local expert parameters of a sharded model and their gradients' way to DDP's mean."""

    def __init__(self, params: dict[str, nn.Parameter], groups: ExpertGroups, stats: CommStats,
                 device: Optional[torch.device], registrations: Optional[dict[str, list[tuple[nn.Module, str]]]] = None,
                 modules: Optional[dict[str, int]] = None) -> None:
        self.params = params
        #: the experts modules (fqn -> number of experts), for the plan printout
        self.modules = modules or {}
        #: every (module, name) each stack is registered as (a meta-device stack is replaced there by ``split``)
        self.registrations = registrations or {}
        self.groups = groups
        self.stats = stats
        self.device = device
        #: the expert-parallel group as a DeviceMesh (checkpoints: each slice a DTensor chunk); set by ``split``
        self.mesh: Any = None
        #: this backward's local gradient of each parameter (by id), summed over its uses
        self._local: dict[int, torch.Tensor] = {}
        self._handles = [p.register_hook(self._take(p)) for p in params.values() if p.requires_grad]

    def _take(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            held = self._local.get(id(p))
            self._local[id(p)] = grad.detach().clone() if held is None else held.add_(grad)
            # autograd adds zeros to .grad instead: .grad holds only reduced gradients (accumulation
            # over micro-batches as for the owners' parameters)
            return torch.zeros_like(grad)
        return hook

    def split(self, stacks: dict[str, Any]) -> None:
        """Keep this rank's experts of the stage's first rank's stacks (global rank 0's without pipeline
        parallelism; collective over the stage: one scatter per stack),
        on the sharding device, each marked with its whole stack's declaration (``stacks``: fqn ->
        ``ExpertStack`` or None, from the roles ``classify`` gave the whole tensors), so the
        optimizers step the ``E/EP`` local experts as matrices of their own."""
        rank0 = dist.get_rank() == self.groups.source
        self.mesh = expert_mesh(self.groups)
        for fqn, p in list(self.params.items()):
            s = expert_slice_of(p)
            if s.from_meta:  # its local experts, uninitialized until the model's meta-device initialization
                local = torch.empty((s.count, *s.global_shape[1:]), dtype=p.dtype, device=self.device)
                p = self._replace(fqn, p, local)
            else:
                local = rank0_slices(p.data if rank0 else None, s.global_shape, p.dtype, self.groups, self.stats)
                p.data = local.to(self.device if self.device is not None else p.device)
            tag_stack(p, stacks.get(fqn))

    def _replace(self, fqn: str, p: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
        """A new parameter of ``data`` in place of meta-device ``p`` (whose data cannot become a real
        tensor), registered where ``p`` was, with its expert slice and gradient hook."""
        q = nn.Parameter(data, requires_grad=p.requires_grad)
        for m, name in self.registrations.get(fqn, ()):
            m._parameters[name] = q
        tag_expert_slice(q, expert_slice_of(p))
        self.params[fqn] = q
        if p.requires_grad:
            self._handles.append(q.register_hook(self._take(q)))
        return q

    def note(self, is_matrix: dict[str, bool], ns_steps: int) -> PlanNote:
        """What the plan shows of the local experts (``Plan.notes``, not in the digest): the parameter
        bytes, resident bytes (gradients and optimizer state by the planner's cost model) and optimizer
        FLOPs each rank adds for its experts (the same on every rank), the stacks it steps, and which
        experts each rank holds. ``is_matrix``: each stack's role (GPT-OSS's expert biases are AdamW tail)."""
        param_bytes = resident = flops = matrices = 0
        for fqn, p in self.params.items():
            kind = RoleKind.MATRIX if is_matrix.get(fqn, False) else RoleKind.TAIL
            spec = ParamSpec(fqn, tuple(p.shape), str(p.dtype).replace("torch.", ""), kind is RoleKind.MATRIX,
                             p.requires_grad, stack_of(p))
            nbytes, nflops = role_cost(kind, [spec], ns_steps)
            param_bytes, resident, flops = param_bytes + spec.nbytes, resident + nbytes, flops + nflops
            matrices += kind is RoleKind.MATRIX
        return PlanNote("expert_parallel", (self.describe(param_bytes, resident),), param_bytes, resident, flops,
                        matrices)

    def describe(self, param_bytes: int, resident: int) -> str:
        """The plan printout's lines: the groups, then which experts each rank holds."""
        g = self.groups
        lines = [f"expert_parallel: EP={g.ep_size} (groups of {g.ep_size} consecutive ranks; {g.replica_size} "
                 f"cop{'y' if g.replica_size == 1 else 'ies'} of each expert); {len(self.params)} stacked "
                 f"parameters split by expert, outside the roles; every rank holds {param_bytes / 2**20:.2f} MiB of "
                 f"expert weights ({resident / 2**20:.2f} MiB with gradients and optimizer state), counted in the "
                 "table above; the experts each global rank keeps:"]
        sizes = sorted(set(self.modules.values()))
        for place in range(g.ep_size):
            ranks = list(g.stage[place::g.ep_size])
            held = ", ".join(f"[{place * e // g.ep_size}, {(place + 1) * e // g.ep_size})"
                             + (f" of the {e}-expert modules" if len(sizes) > 1 else "") for e in sizes)
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            lines.append(f"  {who}: experts {held} of every experts module")
        names = ", ".join(self.modules)
        lines.append(f"  experts modules ({len(self.modules)}): {names}")
        return "\n".join(lines)

    def finish_backward(self, sync: bool = True) -> None:
        """End of backward (collective, the same on every rank): the local gradients summed over
        the expert replicas and divided by the data-parallel size, added to ``.grad``; zeros
        where this rank has none. With ``sync`` off (no-sync accumulation) they wait for the next
        backward that reduces."""
        if not sync:
            return
        trainable = [p for p in self.params.values() if p.requires_grad]
        grads = [self._local.pop(id(p), None) for p in trainable]
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(trainable, grads)]
        start_replica_sum(grads, self.groups, self.stats).wait()
        for p, g in zip(trainable, grads):
            if self.groups.dp_size > 1:
                g.div_(self.groups.dp_size)
            g = g.to(p.dtype)
            p.grad = g if p.grad is None else p.grad.add_(g)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _describe(seams: list[ExpertSeam]) -> list[tuple]:
    return [(s.fqn, type(s.module).__name__, s.num_experts,
             tuple((n, tuple(s.module._parameters[n].shape), str(s.module._parameters[n].dtype),
                    s.module._parameters[n].is_meta) for n in s.names)) for s in seams]


def _agree(ep: int, seams: list[ExpertSeam], mesh: MeshInfo) -> ParallelDims:
    """Refuse, on every rank and before any other collective, what expert parallelism cannot run;
    the run's sizes (``expert_parallel_size`` against TP and the data-parallel size, the experts of
    each module) are the mesh record's checks."""
    if not (dist.is_available() and dist.is_initialized()):
        raise MatrixShardError(f"expert_parallel_size={ep} needs an initialized process group")
    world = dist.get_world_size()
    dims = dims_of(mesh, ep)  # refuses EP with TP, or not dividing the data-parallel size (the same on every rank)
    if dims.world != world or mesh.dp_size != dims.data_parallel:
        raise MatrixShardError(f"expert_parallel_size={ep} needs the model sharded over the whole world "
                               f"({world} ranks), or over a pipeline stage's data-parallel ranks as build_pipeline "
                               f"shards each stage; its data-parallel size is {mesh.dp_size}")
    # the agreement: one gather over the ranks that split these experts (the stage's), each reads every view
    every = gather_objects(_describe(seams), mesh.experts.stage_group if mesh.experts is not None else None)
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            raise MatrixShardError(f"expert_parallel_size={ep}: the experts modules differ across ranks (rank 0: "
                                   f"{_first_difference(every[0], theirs)}; rank {r}: "
                                   f"{_first_difference(theirs, every[0])}); every rank must build the same model")
    if not seams:
        raise MatrixShardError(f"expert_parallel_size={ep} but the model has no experts module (a Hugging Face "
                               "experts module taking (hidden_states, top_k_index, top_k_weights), or one declared "
                               "with lightning_matrixfsdp.parallelize_experts); use expert_parallel_size=1")
    for s in seams:
        dims.check_experts(s.num_experts, s.fqn)
    return dims


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return repr(x)
    return f"{len(a)} experts modules" if len(a) != len(b) else "the same"


def prepare_experts(module: nn.Module, ep: int, mesh: MeshInfo, device: Optional[torch.device],
                    stats: CommStats, routing: Optional[RoutingCounts] = None) -> Optional[ExpertParallel]:
    """Split every experts module's stacks over the expert-parallel groups (module docstring);
    None without expert parallelism. ``stats``: the model's traffic counters (the token
    all-to-alls count under ``ep_dispatch``/``ep_combine``, the gradient sums under ``experts``).
    ``routing``: where each experts module's dispatch adds the tokens it routed to each expert."""
    if ep == 1:
        return None
    seams = find_seams(module)
    dims = _agree(ep, seams, mesh)
    groups = mesh.experts if mesh.experts is not None else expert_groups(dims)  # built with the mesh, or now
    dispatch = functools.partial(expert_parallel_forward, stats=stats)
    params: dict[str, nn.Parameter] = {}
    registrations: dict[str, list[tuple[nn.Module, str]]] = {}
    for s in seams:
        count = s.num_experts // ep
        for n in s.names:
            p = s.module._parameters[n]
            if expert_slice_of(p) is not None:  # registered twice: split once
                registrations[expert_slice_of(p).fqn].append((s.module, n))
                continue
            fqn = f"{s.fqn}.{n}" if s.fqn else n
            tag_expert_slice(p, ExpertSlice(fqn, tuple(p.shape), groups.ep_rank * count, count, groups, p.is_meta))
            params[fqn] = p
            registrations[fqn] = [(s.module, n)]
        seam_dispatch = dispatch
        if routing is not None:  # the counts the dispatch computes for its exchange, kept for the logs
            routing.add_module(s.fqn, s.num_experts)
            seam_dispatch = functools.partial(dispatch, on_counts=routing.recorder(s.fqn, s.module))
        install_forward(s, seam_dispatch, groups.ep_group, fused=hf_experts_forward)
    return ExpertParallel(params, groups, stats, device, registrations,
                          modules={s.fqn or "<root>": s.num_experts for s in seams})
