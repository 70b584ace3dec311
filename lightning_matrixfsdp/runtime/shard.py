"""``matrix_shard``: walk a model, build its units, plan the owners, apply the plan."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.checks import check_model
from lightning_matrixfsdp.runtime.collectives import DEFAULT_COLLECTIVE, make_collective
from lightning_matrixfsdp.runtime.comm import CommStats, ShardGroup, comm_device
from lightning_matrixfsdp.runtime.consensus import (
    SYNC_BUFFERS,
    make_sequence_check,
    sequence_check_wanted,
    validate_schedule,
)
from lightning_matrixfsdp.runtime.copies import track_copies
from lightning_matrixfsdp.runtime.grad_comm import GradientReducer
from lightning_matrixfsdp.runtime.mesh import hsdp_mesh, shard_and_replicate_groups
from lightning_matrixfsdp.runtime.options import MatrixShardError, check_shard_options
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, UnitSpec
from lightning_matrixfsdp.runtime.planner import make_plan
from lightning_matrixfsdp.runtime.prune_guard import install_prune_guard
from lightning_matrixfsdp.runtime.replica_comm import ReplicaExchange
from lightning_matrixfsdp.runtime.replica_sync import ReplicaSync
from lightning_matrixfsdp.runtime.replicas import assign_steppers
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.sync import BufferSync, agree_params, agree_replicas, buffer_layout
from lightning_matrixfsdp.runtime.tags import attach_state
from lightning_matrixfsdp.runtime.unit import Unit

WrapPolicy = Union[set, frozenset, list, tuple, Callable[[str, nn.Module], bool], None]
MatrixFilter = Callable[[str, nn.Parameter], bool]


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
def matrix_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    wrap_policy: WrapPolicy = None,
    planner: Union[str, Callable[..., Plan]] = "role_greedy",
    collective: str = DEFAULT_COLLECTIVE,
    matrix_filter: Optional[MatrixFilter] = None,
    param_dtype: Union[torch.dtype, str, None] = None,
    reduce_dtype: Union[torch.dtype, str, None] = None,
    reshard_after_forward: bool = True,
    ns_steps: int = 5,
    device: Optional[torch.device] = None,
    shard_size: Optional[int] = None,
    prefetch: bool = True,
    zero_missing_grads: bool = False,
    replica_split: bool = False,
    flatten_conv: bool = False,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """Owner-shard ``module`` in place (like FSDP2's ``fully_shard`` for a whole model).

    Each matrix role (a 2D parameter accepted by ``matrix_filter``) is kept whole on
    one owner rank of the shard group and empty elsewhere; the other parameters of
    each unit form one tail role.  A 2-D ``mesh`` ``(replicate, shard)`` gives HSDP.
    Build optimizers *after* this call, over ``module.parameters()``.  ``device``
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
    # Every option first, before the model is touched (the strategy ran the same checks at construction).
    opts = check_shard_options(
        wrap_policy=wrap_policy, planner=planner, collective=collective, matrix_filter=matrix_filter,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
        ns_steps=ns_steps, shard_size=shard_size, prefetch=prefetch, zero_missing_grads=zero_missing_grads,
        replica_split=replica_split, flatten_conv=flatten_conv, broadcast_buffers=broadcast_buffers, device=device,
        mesh=mesh)
    wrap_policy, planner, param_dtype, reduce_dtype = (opts[k] for k in ("wrap_policy", "planner", "param_dtype",
                                                                           "reduce_dtype"))
    device, shard_size = opts["device"], opts["shard_size"]
    check_model(module)

    if shard_size is not None:
        mesh = hsdp_mesh(shard_size, device)
    shard_pg, replicate_pg = shard_and_replicate_groups(mesh)
    sg = ShardGroup(shard_pg)
    real = [p for p in module.parameters() if not p.is_meta]
    if device is None:
        device = real[0].device if real else comm_device(shard_pg)
    device = torch.device(device)

    # -- units and the parameters each one holds
    units = _select_units(module, wrap_policy)
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
    param_objs: dict[int, nn.Parameter] = {id(p): p for p in module.parameters()}

    def is_matrix(fqn: str, p: nn.Parameter) -> bool:
        if p.ndim < 2 or (p.ndim > 2 and not opts["flatten_conv"]):
            return False
        return bool(matrix_filter(fqn, p)) if matrix_filter is not None else True

    unit_specs = []
    for uname, _ in units:
        specs = []
        for pid, p in param_objs.items():
            if unit_of_param[pid] != uname:
                continue
            fqn = first_fqn[pid]
            specs.append(ParamSpec(fqn, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                   is_matrix(fqn, p), p.requires_grad))
        unit_specs.append(UnitSpec(uname, tuple(specs)))

    replicate_size = dist.get_world_size(replicate_pg) if replicate_pg is not None else 1
    plan = make_plan(unit_specs, sg.size, planner, ns_steps=ns_steps, replicate=replicate_size)
    split = bool(opts["replica_split"]) and replicate_size > 1
    if split:
        plan.steppers, plan.replica_flops = assign_steppers(plan, unit_specs, replicate_size, ns_steps)
    schedule = {
        "collective": collective,
        "param_dtype": str(param_dtype),
        "reduce_dtype": str(reduce_dtype),
        "reshard_after_forward": reshard_after_forward,
        "replicate": replicate_size,
        "prefetch": prefetch,
        "zero_missing_grads": bool(zero_missing_grads),
        "replica_split": split,
        "sequence_check": sequence_check_wanted(sg),
        "broadcast_buffers": opts["broadcast_buffers"],
        "buffers": buffer_layout(module),
    }
    validate_schedule(plan, schedule, sg)
    if replicate_pg is not None:  # HSDP: every replica must hold the same layout too
        validate_schedule(plan, schedule, ShardGroup(replicate_pg))

    # -- every owner on global rank 0's values (DDP's broadcast at wrap), before non-owners drop theirs
    stats = CommStats()
    fqn_to_pid = {first_fqn[pid]: pid for pid in param_objs}
    layouts = [shard for layout in plan.units for shard in layout.shards]
    if not any(p.is_meta for p in param_objs.values()):
        agree_params([param_objs[fqn_to_pid[s.fqn]].data for s in layouts], [s.owner for s in layouts], sg,
                     replicate_pg, stats)

    # -- apply: resident tensors, pinned unsharded buffers, unit hooks
    coll = make_collective(collective, sg, stats)
    exchange = ReplicaExchange(replicate_pg, stats) if split else None
    reducer = GradientReducer(coll, replicate_pg, split=exchange, steppers=plan.steppers)
    options = dict(schedule, planner=plan.planner, ns_steps=ns_steps, prefetch=prefetch)
    state = MatrixFSDPState(module, plan, reducer, options)
    check = make_sequence_check(sg, [u.fqn for u in plan.units]) if schedule["sequence_check"] else None
    if check is not None:
        check.describe = state.describe_waiting
    meta_modules = [m for m in module.modules() if any(p.is_meta for p in m._parameters.values() if p is not None)]
    for index, (layout, (_, umod)) in enumerate(zip(plan.units, units)):
        sparams = []
        for shard in layout.shards:
            pid = fqn_to_pid[shard.fqn]
            sparams.append(ShardedParam(shard, param_objs[pid], regs[pid], sg.rank, device, param_dtype, reduce_dtype))
        is_root = umod is module
        state.add_unit(Unit(umod, layout, sparams, coll, reducer, state.schedule,
                            reshard_after_forward and not is_root, zero_missing_grads=bool(zero_missing_grads),
                            index=index, check=check))
    if exchange is not None:
        root_index = next((i for i, u in enumerate(state.units) if u.module is module), None)
        state.replicas = ReplicaSync([u.params for u in state.units], plan.steppers, exchange, first=root_index)
        for unit in state.units:
            unit.replicas = state.replicas
    _materialize_meta(module, meta_modules, device)
    if meta_modules:  # owners initialized their own roles: the replicas of each owner take replica 0's
        agree_replicas([p.resident.data for p in state.params if p.owned], replicate_pg, stats)
    state.buffers = BufferSync(module, sg, replicate_pg, stats, opts["broadcast_buffers"])
    root_index = next(i for i, u in enumerate(state.units) if u.module is module)
    if check is not None:
        state.buffer_check = lambda: check(SYNC_BUFFERS, root_index)
    state.install_hooks()  # the root's own: replica transfers, rank 0's buffers
    state.broadcast_buffers()
    install_prune_guard()
    attach_state(module, state)
    for unit in state.units:  # a deepcopy of the model or of a unit: sharded like it (weight averaging)
        track_copies(unit.module, state)
    return module


def _materialize_meta(root: nn.Module, meta_modules: list[nn.Module], device: torch.device) -> None:
    """Meta-device models: owners now hold uninitialized full tensors; run each module's
    ``reset_parameters`` (owners fill theirs, others touch empty placeholders)."""
    for m in root.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
            elif b is not None and b.device != device:
                m._buffers[name] = b.to(device)
    for m in meta_modules:
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
