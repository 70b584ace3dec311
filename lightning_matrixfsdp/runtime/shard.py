"""``matrix_shard`` as five named steps, each parallel style contributing through one seam.

1. ``resolve_mesh``: the ``MeshInfo`` and its ``ParallelDims`` record (every size checked);
   ``prepare_styles``: the styles that act before the walk (tensor parallelism; expert
   parallelism, whose experts become local parameters outside every unit).
2. ``collect``: walk the model, classify every parameter's role (units, specs; nothing moves).
3. ``place``: ``planner.make_plan``, the whole plan (owners, and the stepping replicas of
   ``replica_split``), with the runtime's choices and the roles for the printout.
4. Each :class:`Style` (``tp/style.py``, ``experts/style.py``, ``replicas/style.py``)
   contributes to the plan (``plan.notes``: what it holds outside the roles, its printout lines).
5. ``build_runtime``: agree with the other ranks, build the units, each style installs its part.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch
from torch import nn

from lightning_matrixfsdp.runtime.checks import check_model
from lightning_matrixfsdp.runtime.classify import RoleChoice, classify, describe_roles, recipe_roles
from lightning_matrixfsdp.runtime.comm.collectives import make_collective
from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup
from lightning_matrixfsdp.runtime.config import SHARD, MatrixFSDPConfig, bind_options, options_signature
from lightning_matrixfsdp.runtime.consensus import (
    SYNC_BUFFERS,
    make_sequence_check,
    sequence_check_wanted,
    validate_schedule,
)
from lightning_matrixfsdp.runtime.views.copies import track_copies
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.parallel import prepare_experts
from lightning_matrixfsdp.runtime.experts.style import ExpertParallelStyle
from lightning_matrixfsdp.runtime.experts.stats import RoutingCounts, watch_routing
from lightning_matrixfsdp.runtime.comm.grads import GradientReducer
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.mesh.comm import dims_of, is_tp_mesh, mesh_info, shard_mesh
from lightning_matrixfsdp.runtime.options import check_device, check_mesh
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.placement import MatrixShard, ParamSpec, Plan, RoleKind, UnitSpec
from lightning_matrixfsdp.runtime.planner import make_plan
from lightning_matrixfsdp.runtime.prune_guard import install_prune_guard
from lightning_matrixfsdp.runtime.replicas.style import ReplicaSplitStyle
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.sync import BufferSync, agree_params, agree_replicas, buffer_layout
from lightning_matrixfsdp.runtime.tags import attach_state, expert_slice_of, tag_recipe
from lightning_matrixfsdp.runtime.mesh.topology_comm import resolve
from lightning_matrixfsdp.runtime.tp.layout import local_data
from lightning_matrixfsdp.runtime.meta_init import awaits_init, init_tp_meta, materialize_meta, replays_whole
from lightning_matrixfsdp.runtime.tp.plan import TPPlan, localize
from lightning_matrixfsdp.runtime.tp.style import TensorParallelStyle
from lightning_matrixfsdp.runtime.unit import Unit

WrapPolicy = Union[set, frozenset, list, tuple, Callable[[str, nn.Module], bool], None]


# ---------------------------------------------------------------------- units
def _mark_outermost_list_children(module: nn.Module, marked: set[int]) -> None:
    """Children of ``nn.ModuleList``s not inside another list's child. A list nested in a
    block (a mixture-of-experts layer's experts) stays part of that block's unit: a unit
    is materialized collectively, so one that runs on some ranks only (a routed expert)
    cannot be a unit of its own."""
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            marked.update(id(c) for c in child.children())
        else:
            _mark_outermost_list_children(child, marked)


def _select_units(root: nn.Module, wrap_policy: WrapPolicy) -> list[tuple[str, nn.Module]]:
    if wrap_policy is None:  # the children of the outermost nn.ModuleLists: the repeated blocks
        marked = set()
        _mark_outermost_list_children(root, marked)
        pick = lambda name, m: id(m) in marked  # noqa: E731
    elif isinstance(wrap_policy, (set, frozenset, list, tuple)):  # of classes: options.check_wrap_policy ran
        classes = tuple(wrap_policy)
        pick = lambda name, m: isinstance(m, classes)  # noqa: E731
    else:
        pick = wrap_policy
    units = [(name, m) for name, m in root.named_modules() if name and pick(name, m)]
    units = [(n, m) for n, m in units if any(True for _ in m.parameters())]
    return units + [("", root)]


def _unit_of(module_name: str, unit_names: list[str]) -> str:
    """The innermost unit whose subtree holds ``module_name``."""
    best = ""
    for u in unit_names:
        if u and (module_name == u or module_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


# ---------------------------------------------------------------------- entry point
def matrix_shard(module: nn.Module, *, mesh: Any = None, device: Optional[torch.device] = None,
                 config: Optional[MatrixFSDPConfig] = None, **options: Any) -> nn.Module:
    """Owner-shard ``module`` in place (like FSDP2's ``fully_shard`` for a whole model).

    The options come as ``config=MatrixFSDPConfig(...)`` or as its keywords (not both);
    ``mesh``: a DeviceMesh, a ``MeshInfo``, or None (the world, or ``shard_size``'s HSDP mesh).

    Each matrix role (a 2D parameter accepted by ``matrix_filter``, every 2D parameter without
    one, and each declared expert stack, ``expert_stacks``: docs/moe.md) is kept whole on one
    owner rank of the shard group and empty elsewhere; the other parameters of each unit form
    one tail role. Which update each parameter gets is the optimizer's choice, as under DDP:
    ``Muon(module)`` applies the Muon recipe, bare ``module.parameters()`` go by shape. The plan
    printout gives every parameter's role, its update either way, and the rule that chose each
    (``runtime/classify.py``). A 2-D ``mesh`` ``(replicate, shard)`` gives HSDP.
    Build optimizers *after* this call.  ``device``
    moves resident tensors and buffers there while sharding (default: where the
    parameters are, or the current accelerator for a meta-device model), so a
    CPU-built model never needs to fit on one accelerator whole.  ``shard_size=W``
    (without ``mesh``) builds the HSDP mesh ``(world // W, W)`` itself.

    ``zero_missing_grads=True`` is for models whose ranks leave *different* parameters
    without a gradient in one step (mixture-of-experts routing, input-dependent
    branches): every unit then reduces when its backward is done (units whose inputs
    need no gradient: at the end of backward), a parameter without a local gradient
    contributes zeros, and the owner gets the sum, zeros included, as FSDP2 does. A
    parameter unused on every rank then gets a zero gradient instead of ``None``. By
    default (DDP's semantics: ``None`` when unused everywhere) the ranks must leave the
    same parameters unused, or their communication disagrees.

    ``collective="auto"`` and ``replica_split="auto"`` (the defaults) are chosen here from the
    topology (``runtime/mesh/topology.py``): p2p inside one node, broadcast across nodes; the split
    on under HSDP. The choice and its reason are printed with the plan and logged.

    ``replica_split=True`` (HSDP only; without replicas it changes nothing): each role's
    optimizer step runs on one replica, chosen to balance optimizer FLOPs; its gradient is
    reduced to that replica alone, which alone holds the role's optimizer state, and the
    updated weights go to the other replicas after the step, overlapping the next forward
    (docs/multi-node.md).

    ``flatten_conv=True``: a parameter with more than two dimensions (a convolution
    kernel ``(out, in, *k)``) is a matrix role too, when ``matrix_filter`` (now also
    asked about it) accepts it; ``Muon`` orthogonalizes it as the ``(out, in * prod(k))``
    matrix, as several Muon implementations do for convolutional networks.

    As DDP when it wraps a model, every role takes global rank 0's value here (ranks that built
    the model with different weights train rank 0's; ranks that agree move no parameter bytes),
    and so do the buffers. ``broadcast_buffers=True`` (DDP's default) also broadcasts rank 0's
    buffers before each forward that follows a training forward, so BatchNorm statistics are rank
    0's everywhere; ``False`` leaves each rank its own buffers, never broadcast.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"matrix_shard expects an nn.Module, got {type(module).__name__}")
    # Every option first, before the model is touched (a config was checked when it was built).
    config = bind_options(_SIGNATURE, "matrix_shard", (), dict(options, config=config))
    mesh, device = resolve_mesh(module, mesh, device, config)  # 1. the mesh record and its groups
    stats, routing = CommStats(), RoutingCounts()  # routing: tokens per expert for the logs
    styles = prepare_styles(module, config, mesh, device, stats, routing)  # before any other collective
    # "auto" options resolved once, alike on every rank (runtime/mesh/topology.py)
    choice = resolve(config.collective, config.replica_split, mesh)
    config = config.updated(collective=choice.collective, replica_split=choice.replica_split)
    collected = collect(module, config)  # 2. classify roles: units, specs
    for style in styles:
        style.after_collect(collected)
    plan = place(collected, config, mesh, choice)  # 3. place: owners (and stepping replicas)
    if plan.replica_split:
        styles.append(ReplicaSplitStyle(mesh, stats))
    for style in styles:  # 4. each parallel style's contribution to the plan
        style.contribute(plan, collected, config.ns_steps)
    state = build_runtime(module, config, mesh, plan, collected, device, styles, stats)  # 5. build and install
    for fqn, p in module.named_parameters():  # for an optimizer built from the module: Muon(model)
        if fqn in collected.recipe:
            tag_recipe(p, collected.recipe[fqn])
    state.attach_routing(routing)
    return module


class Style(Protocol):
    """One parallel style's contribution to ``matrix_shard``, at each named step (``tp/style.py``,
    ``experts/style.py``, ``replicas/style.py``): a style with nothing to do at a step does nothing."""

    name: str

    def after_collect(self, collected: "Collected") -> None:
        """The roles are known (nothing moved yet)."""

    def contribute(self, plan: Plan, collected: "Collected", ns_steps: int) -> None:
        """The plan is made: add what the style holds outside the roles (``plan.notes``)."""

    def install(self, state: MatrixFSDPState) -> None:
        """The units are built: wire the style's runtime part in, before the hooks are installed."""


def resolve_mesh(module: nn.Module, mesh: Any, device: Optional[torch.device],
                 config: MatrixFSDPConfig) -> tuple[MeshInfo, torch.device]:
    """Step 1: the ``MeshInfo`` of ``mesh`` (a DeviceMesh, a ``MeshInfo`` or None) with its
    ``ParallelDims`` record (every size checked together), and the device to shard onto."""
    if mesh is not None and config.shard_size is not None and not isinstance(mesh, MeshInfo) and not is_tp_mesh(mesh):
        raise MatrixShardError(f"pass either mesh or shard_size, not both (got mesh={mesh!r}, "
                               f"shard_size={config.shard_size!r})")
    if not isinstance(mesh, MeshInfo):
        device, mesh = check_device(device), check_mesh(mesh)
    elif config.shard_size not in (None, mesh.shard_size):
        raise MatrixShardError(f"shard_size={config.shard_size!r} differs from the given MeshInfo's shard span "
                               f"{mesh.shard_size}")
    check_model(module, tensor_parallel=mesh.tp_size > 1 if isinstance(mesh, MeshInfo) else is_tp_mesh(mesh))
    if not isinstance(mesh, MeshInfo):
        mesh = mesh_info(mesh, config.shard_size, device)
    if config.expert_parallel_size == 1 and mesh.dims is None:  # expert parallelism checks its sizes with the model
        mesh = dataclasses.replace(mesh, dims=dims_of(mesh))
    if device is None:
        real = [p for p in module.parameters() if not p.is_meta]
        device = real[0].device if real else mesh.device
    return mesh, torch.device(device)


def prepare_styles(module: nn.Module, config: MatrixFSDPConfig, mesh: MeshInfo, device: torch.device,
                   stats: CommStats, routing: RoutingCounts) -> list[Style]:
    """The parallel styles of this run that act before the walk: tensor parallelism (a TP group
    above one rank), expert parallelism (each rank keeps its experts as local parameters, outside
    every unit; collective: its refusals agree on every rank first)."""
    styles: list[Style] = [TensorParallelStyle(mesh, stats)] if mesh.tp_size > 1 else []
    experts = prepare_experts(module, config.expert_parallel_size, mesh, device, stats, routing)
    if experts is None:
        watch_routing(module, routing)
    else:
        styles.append(ExpertParallelStyle(experts))
    return styles


def place(collected: "Collected", config: MatrixFSDPConfig, mesh: MeshInfo, choice: Any) -> Plan:
    """Step 3: the owners of every role (and, with ``replica_split``, each role's stepping replica),
    with the runtime's choices and the roles for the printout."""
    split, why_not = splits_served(config, mesh, collected.roles)
    plan = make_plan(collected.specs, mesh.shard_size, config.planner, ns_steps=config.ns_steps,
                     replicate=mesh.replicate_size, replica_split=config.replica_split, split_stacks=split)
    if why_not:
        plan.options["split_stacks_reason"] = why_not  # printed; not in the digest
    plan.options.update(collective=choice.collective, collective_reason=choice.collective_reason,
                        replica_split_reason=choice.replica_split_reason)  # printed; not in the digest
    plan.roles = describe_roles(collected.roles, collected.recipe)
    return plan


_SIGNATURE = options_signature(SHARD, keyword_only=True)
matrix_shard.__signature__ = options_signature(  # type: ignore[attr-defined]
    SHARD, keyword_only=True, first=[
        inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module),
        inspect.Parameter("mesh", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any),
        inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Optional[torch.device])])


# ---------------------------------------------------------------------- 1. specs
@dataclass
class Collected:
    """What the model holds, before anything changes: the units (in plan order, the root
    last), their specs, and each parameter by fqn with every (module, name) it is registered as."""

    units: list[tuple[str, nn.Module]]
    specs: list[UnitSpec]
    params: dict[str, nn.Parameter]
    registrations: dict[str, list[tuple[nn.Module, str]]]
    roles: dict[str, RoleChoice]
    #: the Muon recipe's role of every parameter (classify.recipe_roles), recorded on each for Muon(model)
    recipe: dict[str, RoleChoice]


def collect(module: nn.Module, config: MatrixFSDPConfig) -> Collected:
    """The units ``config.wrap_policy`` picks and the spec of every parameter (no tensors moved)."""
    units = _select_units(module, config.wrap_policy)
    unit_names = [n for n, _ in units]
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    first_fqn: dict[int, str] = {}
    unit_of_param: dict[int, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            u = _unit_of(mod_name, unit_names)
            if id(p) in unit_of_param and unit_of_param[id(p)] != u:
                raise MatrixShardError(
                    f"parameter {first_fqn[id(p)]!r} is shared with {fqn!r} across units "
                    f"{unit_of_param[id(p)] or '<root>'!r} and {u or '<root>'!r}; tied weights must live in one "
                    "unit (adjust wrap_policy so both users fall in the same unit, e.g. the root)"
                )
            unit_of_param[id(p)] = u
            first_fqn.setdefault(id(p), fqn)
            if (mod, pname) not in [(m, n) for m, n in regs.get(id(p), [])]:
                regs.setdefault(id(p), []).append((mod, pname))
    # expert-parallel slices are local: no unit materializes or reduces them (experts/parallel.py)
    param_objs: dict[int, nn.Parameter] = {id(p): p for p in module.parameters() if expert_slice_of(p) is None}
    roles = classify(module, config)  # every parameter's placement role, and why (runtime/classify.py)
    recipe = recipe_roles(module, config.expert_stacks, roles)  # and its update under the Muon recipe

    specs = []
    for uname, _ in units:
        params = tuple(ParamSpec(fqn, tuple(p.shape), str(p.dtype).replace("torch.", ""), roles[fqn].is_matrix,
                                 p.requires_grad, roles[fqn].stack,
                                 recipe_adamw=roles[fqn].is_matrix and not recipe[fqn].is_matrix)
                       for pid, p in param_objs.items() if unit_of_param[pid] == uname
                       for fqn in [first_fqn[pid]])
        specs.append(UnitSpec(uname, params))
    return Collected(units, specs, {first_fqn[pid]: p for pid, p in param_objs.items()},
                     {first_fqn[pid]: r for pid, r in regs.items()}, roles, recipe)


# ---------------------------------------------------------------------- 3. the runtime
def agreed_options(config: MatrixFSDPConfig, mesh: MeshInfo, plan: Plan, module: nn.Module) -> dict[str, Any]:
    """What every rank of a group must have chosen alike, beside the plan (compared once, by digest)."""
    return {
        "collective": config.collective,
        "param_dtype": str(config.param_dtype),
        "reduce_dtype": str(config.reduce_dtype),
        "reshard_after_forward": config.reshard_after_forward,
        "replicate": mesh.replicate_size,
        "prefetch": config.prefetch,
        "zero_missing_grads": config.zero_missing_grads,
        "replica_split": plan.replica_split,
        "sequence_check": sequence_check_wanted(mesh.shard),
        "broadcast_buffers": config.broadcast_buffers,
        "buffers": buffer_layout(module),
    }


def build_runtime(module: nn.Module, config: MatrixFSDPConfig, mesh: MeshInfo, plan: Plan, collected: Collected,
                  device: torch.device, styles: Sequence[Style] = (),
                  stats: Optional[CommStats] = None) -> MatrixFSDPState:
    """Agree on plan and options, take rank 0's values, and build the parameters, units and hooks,
    each style installing its part once the units are built. With tensor parallelism the TP group
    agrees on the global plan and TP layouts first, and this rank's data-parallel group then runs
    the plan at its fragments' shapes."""
    sg, replicate_pg = mesh.shard, mesh.replicate_group
    stats = CommStats() if stats is None else stats  # matrix_shard's (expert parallelism counted already)
    tp_plan = next((s.tp_plan for s in styles if isinstance(s, TensorParallelStyle)), None)
    plan, agreed = _agree_plan(module, config, mesh, plan, collected, tp_plan, stats)

    # -- apply: resident tensors, pinned unsharded buffers, unit hooks
    coll = make_collective(config.collective, sg, stats)
    split = next((s.exchange for s in styles if isinstance(s, ReplicaSplitStyle)), None)
    reducer = GradientReducer(coll, replicate_pg, mesh.replicate_size, split=split, steppers=plan.steppers)
    state = MatrixFSDPState(module, plan, reducer, mesh, config.prefetch)
    state.tp_plan = tp_plan
    check = make_sequence_check(sg, [u.fqn for u in plan.units]) if agreed["sequence_check"] else None
    if check is not None:
        check.describe = state.describe_waiting
    meta_modules = [m for m in module.modules() if any(awaits_init(p) for p in m._parameters.values())]
    for index, (layout, (_, umod)) in enumerate(zip(plan.units, collected.units)):
        pieces: dict[str, list] = {}  # a split expert stack: its blocks, one entry each
        for shard in layout.shards:
            pieces.setdefault(shard.fqn, []).append(shard)
        sparams = [ShardedParam(ps[0], collected.params[fqn], collected.registrations[fqn], sg.rank, device,
                                config.param_dtype, config.reduce_dtype, alone=sg.size == 1,
                                dtensor=dtensor_spec(collected.params[fqn]), pieces=ps)
                   for fqn, ps in pieces.items()]
        state.add_unit(Unit(umod, layout, sparams, coll, reducer, state.schedule,
                            config.reshard_after_forward and umod is not module,
                            zero_missing_grads=config.zero_missing_grads, index=index, check=check))
    if plan.split_stacks:  # blocks of experts: checkpoints store each as a chunk of the whole stack
        state.stack_mesh = shard_mesh(sg.group, list(sg.global_ranks))
    for style in styles:  # TP: each fragment's stepper; replica_split: the weights' transfers; EP: its gradients
        style.install(state)
    whole = replays_whole(meta_modules, tp_plan)  # TP, or expert stacks on meta: whole tensors initialized once,
    materialize_meta(module, [] if whole else meta_modules, device)  # sliced over the TP group / the experts' ranks
    if whole:
        init_tp_meta(meta_modules, state.params, tp_plan, mesh.tp, device, stats)
    if meta_modules:  # owners initialized their own roles: the replicas of each owner take replica 0's
        agree_replicas([p.resident.data for p in state.params if p.owned], replicate_pg, stats)
    # what no reset_parameters initialized (Hugging Face experts, routers, norms): loads must fill it
    state.uninitialized = {id(p) for m in meta_modules if not callable(getattr(m, "reset_parameters", None))
                           for p in m._parameters.values() if p is not None}
    state.buffers = BufferSync(module, sg, replicate_pg, stats, config.broadcast_buffers)
    if check is not None:
        root_index = next(i for i, u in enumerate(state.units) if u.module is module)
        state.buffer_check = lambda: check(SYNC_BUFFERS, root_index)
    state.install_hooks()  # the root's own: replica transfers, rank 0's buffers
    state.broadcast_buffers()
    install_prune_guard()
    attach_state(module, state)
    for unit in state.units:  # a deepcopy of the model or of a unit: sharded like it (weight averaging)
        track_copies(unit.module, state)
    return state


def _agree_plan(module: nn.Module, config: MatrixFSDPConfig, mesh: MeshInfo, plan: Plan, collected: Collected,
                tp_plan: Optional[TPPlan], stats: CommStats) -> tuple[Plan, dict[str, Any]]:
    """Every group agrees on the plan and options (the TP group first, on the global plan and TP
    layouts; then this rank's plan at its fragment shapes), and every owner takes global rank 0's
    values (DDP's broadcast at wrap), before non-owners drop theirs. Returns (this rank's plan, the
    agreed options)."""
    sg, replicate_pg = mesh.shard, mesh.replicate_group
    agreed = agreed_options(config, mesh, plan, module)
    if tp_plan is not None:  # the same owners and TP steppers on every TP rank, before anything moves
        validate_schedule(plan, {**agreed, "tensor_parallel": tp_plan.to_dict()}, mesh.tp,
                          "tensor-parallel group")
        plan = localize(plan, tp_plan.layouts, mesh.tp_rank)
    validate_schedule(plan, agreed, sg)
    if replicate_pg is not None:  # HSDP: every replica must hold the same layout too
        validate_schedule(plan, agreed, ShardGroup(replicate_pg))
    params = collected.params
    layouts = [shard for layout in plan.units for shard in layout.shards]
    if not any(p.is_meta for p in params.values()):  # a split stack's blocks: each block's rows, to its owner
        agree_params([_rows(local_data(params[s.fqn]).data, s) for s in layouts], [s.owner for s in layouts], sg,
                     replicate_pg, stats)
    return plan, agreed


def _rows(t: torch.Tensor, shard: MatrixShard) -> torch.Tensor:
    """The rows of the whole tensor ``t`` that ``shard`` places (a split stack's block, else all)."""
    return t if shard.experts is None else t[shard.experts[0]:shard.experts[1]]


def splits_served(config: MatrixFSDPConfig, mesh: MeshInfo, roles: dict[str, RoleChoice]) -> tuple[bool, str]:
    """Whether the planner may split expert stacks in this run, and why not (for the printout, when
    the model has stacks): not with tensor parallelism, HSDP replicas or expert parallelism (not
    served yet)."""
    if not config.split_stacks:
        return False, ""
    if not any(r.is_matrix and r.stack is not None for r in roles.values()):
        return False, ""
    if mesh.tp_size > 1:
        return False, "off: tensor parallelism keeps every expert stack whole (TP fragments are not split by expert)"
    if mesh.replicate_size > 1:
        return False, "off: HSDP replicas keep every expert stack whole (split stacks are served on one shard group)"
    if config.expert_parallel_size > 1:
        return False, "off: expert parallelism keeps its experts local; other stacks stay whole beside it"
    return True, ""


def dtensor_spec(p: nn.Parameter) -> Optional[tuple[Any, tuple, torch.Size, tuple[int, ...]]]:
    """(mesh, placements, global shape, global stride) of a DTensor parameter, None for a plain one."""
    from torch.distributed.tensor import DTensor

    return (p.device_mesh, tuple(p.placements), p.shape, p.stride()) if isinstance(p, DTensor) else None
