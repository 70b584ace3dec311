"""Copies of a sharded model (weight averaging): sharded like the model, never whole.

Lightning's ``StochasticWeightAveraging`` and ``WeightAveraging`` callbacks keep an
averaged copy of the LightningModule, made with ``copy.deepcopy`` in their ``setup``
hook, which runs *before* the strategy shards the model. Afterwards they only walk
``model.parameters()`` and the copy's side by side (average, swap, copy back) and call
``state_dict``/``load_state_dict`` on the copy. So a copy works under owner sharding if
each of its parameters has the shape of the model's parameter on the same rank: the
whole tensor where this rank owns it (its block of experts for a stack the plan splits), an
empty placeholder elsewhere. Each owner then
averages exactly what it owns, elementwise, as DDP does on the whole tensor.

``track_copies`` makes every ``deepcopy`` of a module such a copy: copies made before the
module is sharded are recorded and sharded by ``shard_copies`` right after it is; copies
made later are sharded at once (without copying the runtime: process groups, units and
hooks stay with the model). A copy's parameters carry the model parameters' placement
marks, and its ``state_dict`` marks every sharded tensor with its model key
(``tags.tag_view``), which is how checkpoints find and write the owners' data of an
averaged model wherever a callback puts it. A copy cannot run forward: its placeholders
hold no data, and it has no units to materialize them. With tensor parallelism a copy holds
what the model holds: this TP rank's fragment of a split parameter where its owner is.
"""

from __future__ import annotations

import copy as _copy
import weakref
from typing import Any

import torch
from torch import nn

from lightning_matrixfsdp.runtime.param import placeholder_shape
from lightning_matrixfsdp.runtime.tags import (
    detach_state,
    is_owned,
    shard_of,
    sharded_roots,
    state_of,
    tag_param,
    tag_unowned,
    tag_view,
)

__all__ = ["copies_of", "shard_copies", "shard_copy", "track_copies"]

# module -> weak references to its copies made before it was sharded
_PENDING: "weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]]" = weakref.WeakKeyDictionary()
# model -> its sharded copies (weak: a copy is the callback's to keep or drop)
_SHARDED: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]]" = weakref.WeakKeyDictionary()


def track_copies(module: nn.Module, state: Any = None) -> None:
    """From now on every ``copy.deepcopy(module)`` is sharded like ``module``: at once if it is
    sharded (``state``: the runtime state of the root whose unit ``module`` is, for a unit that
    is not the root; found from ``module`` otherwise), else by the next ``shard_copies(module)``.
    Idempotent. ``matrix_shard`` calls it for every unit; the strategy for the LightningModule
    before the callbacks' ``setup`` copies it."""
    if isinstance(module.__dict__.get("__deepcopy__"), _Copier):
        return
    _PENDING.setdefault(module, [])
    # An instance attribute: copy.deepcopy looks ``__deepcopy__`` up on the object, so this
    # one module's copies take this path and its class (the user's LightningModule) is untouched.
    object.__setattr__(module, "__deepcopy__", _Copier(module, state))


def shard_copies(module: nn.Module) -> None:
    """Shard the copies of ``module`` made (by ``track_copies``' hook) before it was sharded."""
    refs = _PENDING.get(module, [])
    _PENDING[module] = []
    for ref in refs:
        c = ref()
        if c is not None:
            shard_copy(c, module)


def copies_of(model: nn.Module) -> list[nn.Module]:
    """The live copies of ``model`` that ``shard_copy`` sharded."""
    return list(_SHARDED.get(model, ()))


class _Copier:
    """The ``__deepcopy__`` ``track_copies`` gives one module."""

    def __init__(self, module: nn.Module, state: Any = None) -> None:
        self.ref = weakref.ref(module)
        self.state = weakref.ref(state) if state is not None else None

    def __reduce__(self) -> tuple:
        # A pickled module (``torch.save(model)``) comes back without the hook: ``None`` in its
        # place, which ``copy.deepcopy`` reads as "no hook".
        return (type(None), ())

    def __call__(self, memo: dict) -> nn.Module:
        src = self.ref()
        assert src is not None
        hook = src.__dict__.pop("__deepcopy__")  # the copy must not inherit it, and the copy below must not recurse
        try:
            states = [state_of(r) for r in sharded_roots(src)]
            unit_state = self.state() if self.state is not None else None
            if not states and unit_state is not None:
                if state_of(unit_state.root) is not unit_state:
                    # full_model holds the model as a plain module on this rank for now: a plain copy
                    return _copy.deepcopy(src, memo)
                states = [unit_state]  # a unit inside a sharded root
            if not states:
                out = _copy.deepcopy(src, memo)
                _PENDING.setdefault(src, []).append(weakref.ref(out))
                return out
            out = _copy_sharded(src, states, memo)
            shard_copy(out, src)
            return out
        finally:
            object.__setattr__(src, "__deepcopy__", hook)


def _copy_sharded(src: nn.Module, states: list[Any], memo: dict) -> nn.Module:
    """``deepcopy`` of a sharded module without its runtime: the states and units are mapped
    to themselves (so process groups are never copied), then every hook bound to them and
    every state mark is removed from the copy. Resident parameters copy as they are (full
    where owned, placeholders elsewhere)."""
    runtime: list[Any] = []
    for st in states:
        if any(u.is_materialized for u in st.units):
            raise RuntimeError(
                "deepcopy of a matrix_fsdp-sharded model while one of its units is materialized (inside a forward "
                "or backward): copy it between steps, e.g. in a callback's setup or on_train_batch_end")
        runtime += [st, *st.units]
    for obj in runtime:
        memo[id(obj)] = obj
    out = _copy.deepcopy(src, memo)
    ids = {id(o) for o in runtime}
    for m in out.modules():
        _drop_hooks(m, ids)
        detach_state(m)
    return out


def _bound_to(fn: Any, ids: set[int]) -> bool:
    """Whether hook ``fn`` is a method of, or a closure over (also through a weak reference),
    one of the objects ``ids``."""
    if id(getattr(fn, "__self__", None)) in ids:
        return True
    for cell in getattr(getattr(fn, "__func__", fn), "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, weakref.ref):
            v = v()
        if id(v) in ids:
            return True
    return False


def _drop_hooks(m: nn.Module, ids: set[int]) -> None:
    for name, hooks in list(vars(m).items()):
        if not (name.endswith("_hooks") and isinstance(hooks, dict)):
            continue
        for hid in [k for k, fn in hooks.items() if _bound_to(fn, ids)]:
            del hooks[hid]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(m, extra, {}).pop(hid, None)


def shard_copy(copy: nn.Module, model: nn.Module) -> None:
    """Make ``copy`` (a ``deepcopy`` of ``model``, before or after ``model`` was sharded) hold
    what this rank holds of ``model``: every sharded parameter full where this rank owns it,
    an empty placeholder elsewhere, with the model parameter's placement marks. Buffers and
    unsharded parameters stay as they are (whole, as in the model). A copy of a meta-device
    model takes the values the model was initialized with when it was sharded."""
    mine = dict(model.named_parameters(remove_duplicate=False))
    theirs = list(copy.named_parameters(remove_duplicate=False))
    names = [n for n, _ in theirs]
    if set(names) != set(mine):
        only_copy = sorted(set(names) - set(mine))[:3]
        only_model = sorted(set(mine) - set(names))[:3]
        raise RuntimeError(
            f"a copy of the model ({type(copy).__name__}) does not have the model's parameters (only in the copy: "
            f"{only_copy}, only in the model: {only_model}): it was made before the model was complete (e.g. a "
            "callback's setup copied the module before configure_model built its layers). Under matrix_fsdp the "
            "copy must mirror the sharded model; build the layers in __init__, or make the copy after "
            "configure_model")
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in copy.modules():
        for pname, q in m._parameters.items():
            if q is not None:
                regs.setdefault(id(q), []).append((m, pname))
    done: set[int] = set()
    layouts = _tp_layouts(model)
    with torch.no_grad():
        for name, p in theirs:
            ref = mine[name]
            shard = shard_of(ref)
            if id(p) in done:
                continue
            if shard is None:
                if not is_owned(ref) and ref.numel() == 0:  # another pipeline stage's: nothing of it here
                    done.add(id(p))
                    p.data = torch.empty(0, dtype=p.dtype, device=ref.device)
                    tag_unowned(p)
                continue
            done.add(id(p))
            fragment = _tp_fragment(p, layouts.get(id(ref)))
            if fragment is not None:  # a copy made before sharding: this TP rank's fragment, as the model holds
                new = nn.Parameter(fragment, requires_grad=p.requires_grad)
                for m, pname in regs.get(id(p), []):
                    m._parameters[pname] = new
                p = new
            owned = is_owned(ref)
            full, empty, block = tuple(shard.shape), placeholder_shape(tuple(shard.shape)), tuple(shard.block_shape)
            if owned and block != full and tuple(p.shape) == full and not p.is_meta:
                # a split expert stack copied before sharding: keep this owner's block of experts
                p.data = p.data[shard.experts[0]:shard.experts[1]].clone()
            if tuple(p.shape) not in (full, empty, block):
                raise RuntimeError(f"parameter {name!r} of a copy of the model has shape {tuple(p.shape)}; the "
                                   f"model's is {full}: the copy is not a copy of this model")
            if p.is_meta:  # a copy of a meta-device model: a new Parameter, holding the initialized values
                data = ref.detach().clone() if owned else torch.empty(empty, dtype=p.dtype, device=ref.device)
                new = nn.Parameter(data, requires_grad=p.requires_grad)
                for m, pname in regs.get(id(p), []):
                    m._parameters[pname] = new
                p = new
            elif not owned:
                p.data = torch.empty(empty, dtype=p.dtype, device=p.device)
            tag_param(p, shard, owned)
        model_buffers = dict(model.named_buffers(remove_duplicate=False))
        for m_name, m in copy.named_modules():
            for bname, b in list(m._buffers.items()):
                key = f"{m_name}.{bname}" if m_name else bname
                if b is not None and b.is_meta and key in model_buffers:
                    m._buffers[bname] = model_buffers[key].detach().clone()
    if not any(copy in cs for cs in _SHARDED.values()):
        copy.register_state_dict_post_hook(_mark_views)
        copy.register_forward_pre_hook(_refuse_forward)
    _SHARDED.setdefault(model, weakref.WeakSet()).add(copy)


def _tp_layouts(model: nn.Module) -> dict[int, tuple[Any, int]]:
    """id(resident parameter) -> (its TP layout, this TP rank), for every TP-split parameter of ``model``."""
    out: dict[int, tuple[Any, int]] = {}
    for root in sharded_roots(model):
        st = state_of(root)
        if st is None or st.tp_plan is None:
            continue
        for sp in st.params:
            lay = st.tp_plan.layouts.get(sp.shard.fqn)
            if lay is not None and lay.split:
                out[id(sp.resident)] = (lay, st.mesh.tp_rank)
    return out


def _tp_fragment(p: torch.Tensor, tp: Any) -> Any:
    """This TP rank's fragment of a copy's parameter made before the model was sharded, or None (the
    copy already has the model's local shape): a DTensor (the copy of a parallelized model) gives its
    local fragment; a whole tensor of a split parameter's global shape (a copy made before the TP plan
    was applied, as ``StochasticWeightAveraging``'s ``setup`` makes it) its slice, as ``parallelize_module``
    cuts it."""
    if hasattr(p, "device_mesh") and hasattr(p, "to_local"):
        return p.to_local().detach()
    if tp is None or p.is_meta:
        return None
    lay, rank = tp
    if tuple(p.shape) != tuple(lay.global_shape) or tuple(p.shape) == lay.local_shape(rank):
        return None
    return p.detach().narrow(lay.dim, lay.offset(rank), lay.sizes[rank]).clone()


def _mark_views(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook of a sharded copy: mark every sharded tensor with its model key
    (the copy's parameter names are the model's)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        t = state_dict.get(prefix + name)
        if isinstance(t, torch.Tensor) and shard_of(p) is not None:
            tag_view(t, name)


def _refuse_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"this {type(module).__name__} is a copy of a matrix_fsdp-sharded model (e.g. the averaged model of a "
        "weight-averaging callback): it holds only the weights this rank owns and cannot run forward. Copy its "
        "weights into the model (as the callbacks do at the end of training) and run the model")
