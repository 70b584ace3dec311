"""Driving a single-device library matrix optimizer per parameter, with its state flat in ours.

The shared base of :class:`~.matrix_optimizers.SOAP` and :class:`~.matrix_optimizers.Shampoo`
(the choice of library is explained in :mod:`.matrix_optimizers`).

How the library is driven
-------------------------
Routing, the AdamW part and ``step()`` are the shared :class:`~.tail.TailOptimizer`'s, as
for Muon: a parameter with the matrix role (untagged: ``ndim == 2``) goes to the library
optimizer, applied to that one parameter, whole; everything else gets
``torch.optim.AdamW``'s math and state keys. Parameters without a gradient and empty
non-owner placeholders are skipped.

The library keeps its step counter in the *param group* and, for ScalableShampoo, Python
objects (``PreConditioner``, ``Graft``) in the state. A group counter breaks when routing
changes which parameters a group holds (resharding), and objects do not survive
``torch.load(weights_only=True)`` or DCP. So each matrix is stepped alone through a private
inner library instance, and its state lives flat in ``self.state[p]``:

* ``"step"``: this parameter's step count (CPU float tensor, like Adam's);
* the library's tensors and scalars under their own names;
* list entries as ``"name.i"`` (an empty placeholder list as an empty 1-D tensor);
* tensor attributes of library objects as ``"name.attr"`` / ``"name.attr.i"``; the
  objects are rebuilt by the library's own initializer and re-bound to those tensors.

So ``state_dict()`` holds only tensors and plain scalars, keyed by our own parameters,
and round-trips exactly. The step count is per parameter: a step in which a matrix has no
gradient does not advance it (the library alone would advance its group counter).

Learning rates: the group's ``lr`` (and every other library hyper-parameter) is copied
into the inner instance at every step, so LR schedulers drive it. ``adamw_lr=None`` means
"use the group's ``lr``"; an explicit ``adamw_lr`` is scaled by ``lr / lr_at_init`` like
``Muon`` does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_matrixfsdp.runtime.tags import stack_of, tp_of
from lightning_matrixfsdp.runtime.tp.step_comm import gather_to_steppers, scatter_from_steppers

from .tail import TailOptimizer, as_float, check_adamw_group, check_nonneg, scalar_dtype, stack_pieces

__all__ = ["LIBRARY_REQUIREMENT", "MatrixLibraryOptimizer"]

#: pip requirement of the wrapped library.
LIBRARY_REQUIREMENT = "pytorch-optimizer>=3.6"
_LIBRARY = "pytorch_optimizer"
_SCALARS = (int, float, bool, str, type(None))
_ALIGN = 64  # bytes: what a fresh allocation is aligned to (torch's CPU allocator; CUDA's is coarser)

def _library_class(name: str) -> type[torch.optim.Optimizer]:
    """The library's optimizer class, imported on first use (an optional dependency)."""
    try:
        module = importlib.import_module(_LIBRARY)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"lightning_matrixfsdp's Shampoo/SOAP wrap {_LIBRARY}; install it: pip install '{LIBRARY_REQUIREMENT}'"
        ) from err
    return getattr(module, name)


@contextlib.contextmanager
def _private_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Seeded random numbers for library code, leaving the caller's generators untouched.

    ScalableShampoo's inverse roots start a power iteration from ``torch.randn``. Drawn from
    the global generator, that would (a) advance each rank's RNG by an amount depending on
    which matrices it owns, so dropout etc. would drift from the DDP run, and (b) make a
    matrix's update depend on the other matrices stepped before it. A per-matrix seed makes
    the update a function of that matrix alone, for any plan or world size.
    """
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    backend = getattr(torch, device.type)
    index = device.index if device.index is not None else backend.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type), backend.device(index):
        backend.manual_seed(seed)
        yield


def _is_hole(value: Any) -> bool:
    """An empty 1-D tensor: how an empty placeholder list entry is stored."""
    return isinstance(value, Tensor) and value.ndim == 1 and value.numel() == 0


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, Tensor) for v in value)


def _object_tensors(obj: Any) -> dict[str, Tensor]:
    """The evolving state of a library object: its tensor and list-of-tensor attributes."""
    out: dict[str, Tensor] = {}
    for attr, value in vars(obj).items():
        if isinstance(value, Tensor):
            out[attr] = value
        elif _is_tensor_list(value):
            out.update({f"{attr}.{i}": v for i, v in enumerate(value)})
    return out


def _bind_object(obj: Any, flat: dict[str, Tensor], name: str) -> None:
    """Point ``obj``'s tensor attributes at the stored tensors (structure comes from ``obj``)."""
    flat = dict(flat)
    try:
        for attr, value in list(vars(obj).items()):
            if isinstance(value, Tensor):
                setattr(obj, attr, flat.pop(attr))
            elif _is_tensor_list(value):
                setattr(obj, attr, [flat.pop(f"{attr}.{i}") for i in range(len(value))])
    except KeyError as err:
        raise ValueError(f"optimizer state of {name!r} lacks {err.args[0]!r}: saved by another layout?") from None
    if flat:
        raise ValueError(f"optimizer state of {name!r} has unexpected entries {sorted(flat)}")


class MatrixLibraryOptimizer(TailOptimizer):
    """A library matrix optimizer (per parameter) on matrix roles, AdamW on the rest."""

    _library_name: ClassVar[str]
    #: group keys handed to the library constructor under the same names
    _matrix_keys: ClassVar[tuple[str, ...]]
    _group_level_keys: ClassVar[dict[str, frozenset[str]]] = {}
    #: the library draws random numbers in step(): give it a private, per-matrix seeded stream
    _uses_rng: ClassVar[bool] = False
    #: a split matrix is stepped whole on its TP stepper, which alone holds its state
    whole_tp_state: ClassVar[bool] = True
    #: flat state lists the library keeps column-major (LAPACK's ``qr``/``eigh`` outputs); a
    #: checkpoint keeps values, not strides, so a load lays them out so again: CPU matmuls round
    #: by layout, and the resumed run must continue bit for bit
    _column_major_state: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ groups

    def _validate_group(self, group: dict[str, Any]) -> None:
        """AdamW checks as Muon does; the library constructor checks its own values."""
        check_nonneg("Learning rate", group["lr"])
        check_adamw_group(group)
        check_nonneg("weight_decay", group["weight_decay"])
        self._inner(self._library_kwargs(group))

    def _library_kwargs(self, group: dict[str, Any]) -> dict[str, Any]:
        """The library constructor's arguments for one of our groups."""
        kwargs = {key: group[key] for key in self._matrix_keys}
        kwargs["lr"] = as_float(kwargs["lr"])
        return kwargs

    # ----------------------------------------------------------- inner library

    def _inner(self, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        """A cached library instance for these hyper-parameters (validated by its constructor).

        Values the library keeps in its param group (lr, betas, ...) are copied in at each
        step, so only the ones it keeps on the instance pick the cache entry: a scheduler
        changing ``lr`` every step does not rebuild anything.
        """
        cls = _library_class(self._library_name)
        group_keys = self._group_level_keys.get(self._library_name)
        if group_keys is None:
            group_keys = frozenset(cls([torch.zeros(1)]).defaults)
            self._group_level_keys[self._library_name] = group_keys
        key = repr(sorted((k, v) for k, v in kwargs.items() if k not in group_keys))
        cache: dict[str, torch.optim.Optimizer] = self.__dict__.setdefault("_inner_cache", {})
        inner = cache.get(key)
        if inner is None:
            try:
                inner = cls([torch.zeros(1)], **kwargs)
            except (TypeError, ImportError):
                raise
            except Exception as err:  # the library raises its own exception types
                raise ValueError(f"{type(self).__name__}: {err}") from err
            if len(cache) >= 16:  # hyper-parameters scheduled every step: do not grow forever
                cache.clear()
            cache[key] = inner
        inner.param_groups[0].update({k: v for k, v in kwargs.items() if k in group_keys})
        return inner

    def _templates(self, p: Tensor, inner: torch.optim.Optimizer) -> dict[str, Any]:
        """Library objects with the right structure for ``p`` (cached; else the library builds them)."""
        cache: dict[Tensor, dict[str, Any]] = self.__dict__.setdefault("_object_cache", {})
        objects = cache.get(p)
        if objects is None:
            inner.state.pop(p, None)
            inner.init_group(inner.param_groups[0])  # the library's own initializer, for p alone
            fresh = inner.state.pop(p, {})
            objects = {k: v for k, v in fresh.items() if not isinstance(v, (Tensor, list, tuple, *_SCALARS))}
        return objects

    def _unpack(self, p: Tensor, flat: dict[str, Any], inner: torch.optim.Optimizer) -> dict[str, Any]:
        """Our flat state -> the library's state for ``p``."""
        lib: dict[str, Any] = {}
        lists: dict[str, dict[int, Any]] = defaultdict(dict)
        objects: dict[str, dict[str, Tensor]] = defaultdict(dict)
        for key, value in flat.items():
            if key == "step":
                continue
            name, dot, rest = key.partition(".")
            if not dot:
                lib[name] = value
            elif rest.isdigit():
                lists[name][int(rest)] = value
            else:
                objects[name][rest] = value
        for name, entries in lists.items():
            if sorted(entries) != list(range(len(entries))):
                raise ValueError(f"optimizer state list {name!r} has gaps: {sorted(entries)}")
            lib[name] = [[] if _is_hole(entries[i]) else entries[i] for i in range(len(entries))]
        if objects:
            templates = self._templates(p, inner)
            for name, attrs in objects.items():
                if name not in templates:
                    raise ValueError(f"optimizer state entry {name!r} is unknown to {self._library_name}")
                _bind_object(templates[name], attrs, name)
                lib[name] = templates[name]
        return lib

    def _pack(self, p: Tensor, lib: dict[str, Any], step: int) -> dict[str, Any]:
        """The library's state for ``p`` -> our flat state (tensors and plain scalars only)."""
        flat: dict[str, Any] = {"step": torch.tensor(float(step), dtype=scalar_dtype())}
        objects: dict[str, Any] = {}
        for name, value in lib.items():
            if "." in name or name == "step":
                raise TypeError(f"{self._library_name} state key {name!r} clashes with our flat layout")
            if isinstance(value, Tensor) or isinstance(value, _SCALARS):
                flat[name] = value
            elif isinstance(value, (list, tuple)):
                for i, entry in enumerate(value):
                    if isinstance(entry, Tensor):
                        flat[f"{name}.{i}"] = entry
                    elif isinstance(entry, (list, tuple)) and not entry:
                        flat[f"{name}.{i}"] = p.new_empty(0)  # the library's "no factor here"
                    else:
                        raise TypeError(f"cannot store {name}[{i}] of type {type(entry).__name__}")
            else:  # a library object: its tensor attributes are its state
                objects[name] = value
                flat.update({f"{name}.{attr}": t for attr, t in _object_tensors(value).items()})
        if objects:
            self.__dict__.setdefault("_object_cache", {})[p] = objects
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, but keep the saved dtypes (statistics may be float32 for bf16 params)."""
        super().load_state_dict(state_dict)
        self.__dict__.pop("_object_cache", None)  # objects still point at the replaced tensors
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved or p not in self.state:
                continue
            state = self.state[p]
            for key, value in saved.items():
                if key != "step" and isinstance(value, Tensor) and state[key].dtype != value.dtype:
                    state[key] = value.to(device=p.device)
                t = state.get(key)
                if key.partition(".")[0] in self._column_major_state and isinstance(t, Tensor) and t.ndim == 2:
                    state[key] = t.t().contiguous().t()

    # -------------------------------------------------------------------- step

    def _begin_step(self) -> None:
        """Forget objects of parameters no longer optimized here (e.g. dropped by routing)."""
        cache = self.__dict__.get("_object_cache")
        if cache:
            live = {id(p) for g in self.param_groups for p in g["params"]}
            for p in [p for p in cache if id(p) not in live]:
                del cache[p]

    def _matrix_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """The library's step, for each matrix alone, on its flat state. Fragments of a
        tensor-parallel matrix are stepped whole on the matrix's TP stepper (its state whole
        there) and every TP rank takes its slice of the new weight."""
        split = [p for p in params if tp_of(p) is not None]
        stacks = [p for p in params if tp_of(p) is None and stack_of(p) is not None]
        whole = [p for p in params if tp_of(p) is None and stack_of(p) is None]
        wholes: list[Any] = []
        if split:
            frags = [tp_of(p) for p in split]
            gathered = gather_to_steppers(frags + frags, [p.detach() for p in split] + [p.grad for p in split])
            weights, grads = gathered[:len(split)], gathered[len(split):]
            for w, g in zip(weights, grads):
                if w is not None:
                    w.grad = g
            wholes = weights
        inner = self._inner(self._library_kwargs(group))
        inner_group = inner.param_groups[0]
        placeholder = inner_group["params"]
        try:
            for p in whole:
                self._step_one(inner, p, p)
            for p in stacks:
                self._step_stack(inner, p)
            for p, w in zip(split, wholes):
                if w is not None:
                    self._step_one(inner, p, w)
        finally:
            inner_group["params"] = placeholder
            inner_group.pop("step", None)
            inner.state.clear()
        if split:
            new = scatter_from_steppers(frags, wholes, [p.dtype for p in split], split[0].device)
            for p, piece in zip(split, new):
                p.copy_(piece)

    def _step_stack(self, inner: torch.optim.Optimizer, p: Tensor) -> None:
        """One library step of every matrix of an expert stack (each block of each expert alone,
        as a 2-D view of ``p`` with its gradient's view, in ``nn.Linear``'s orientation (out, in)
        whatever the stored layout), its state kept per expert in that orientation: every flat
        entry stacked along a new leading dimension (``p.shape[0]``), under ``block{j}/`` when
        the stack has several row blocks. The same update as one instance per (out, in) matrix."""
        blocks = len(stack_of(p).blocks)
        state = self.state[p]
        data, grad = p.detach(), p.grad
        per_block: list[list[dict[str, Any]]] = [[] for _ in range(blocks)]
        for i, ((e, rows, target), (_, _, g)) in enumerate(zip(stack_pieces(p, data), stack_pieces(p, grad))):
            j = i % blocks
            prefix = f"block{j}/" if blocks > 1 else ""
            flat = {k[len(prefix):]: self._expert_entry(k[len(prefix):], v, e)
                    for k, v in state.items() if k.startswith(prefix)}
            # a strided view (a stack stored transposed or interleaved) is stepped as a contiguous
            # (out, in) copy, as a separate matrix would be, then written back
            work = target if target.is_contiguous() else target.contiguous()
            work.grad = g if work is target else g.contiguous()
            per_block[j].append(self._step_flat(inner, work, flat))
            if work is not target:
                target.copy_(work)
        new: dict[str, Any] = {}
        for j, experts in enumerate(per_block):
            prefix = f"block{j}/" if blocks > 1 else ""
            for key in experts[0]:
                values = [x[key] for x in experts]
                if isinstance(values[0], Tensor):
                    new[prefix + key] = torch.stack(values)
                elif all(v == values[0] for v in values):
                    new[prefix + key] = values[0]  # a plain scalar alike for every expert (kept plain)
                else:
                    new[prefix + key] = torch.tensor(values)
        self.state[p] = new

    def _expert_entry(self, key: str, value: Any, e: int) -> Any:
        """Expert ``e``'s entry of a stack's state, in fresh storage: CPU matmuls round by the
        alignment of their inputs, and a slice of the stacked tensor sits at an offset; a factor
        the library keeps column-major (LAPACK's outputs) is laid out so again. So the expert's
        step rounds as the step of a matrix alone."""
        if not isinstance(value, Tensor) or value.ndim == 0:
            return value
        entry = value[e]
        if key.partition(".")[0] in self._column_major_state and entry.ndim == 2:
            return entry.t().contiguous().t()
        return entry.clone()

    def _step_one(self, inner: torch.optim.Optimizer, p: Tensor, target: Tensor) -> None:
        """One library step of ``target`` (``p`` itself, or the whole matrix of fragment ``p``)
        with the flat state kept under ``p``."""
        self.state[p] = self._step_flat(inner, target, self.state[p])

    def _step_flat(self, inner: torch.optim.Optimizer, target: Tensor, flat: dict[str, Any]) -> dict[str, Any]:
        """One library step of ``target`` from the flat state ``flat``; returns the new flat state."""
        inner_group = inner.param_groups[0]
        inner_group["params"] = [target]
        inner.state.clear()
        if flat:
            inner_group["step"] = int(flat["step"].item())
            inner.state[target] = self._unpack(target, flat, inner)
        else:  # first step: no "step" key, so every library version initializes it
            inner_group.pop("step", None)
        grad = target.grad
        if grad is not None and grad.data_ptr() % _ALIGN:
            # The gradient is a view into the unit's flat buffer at an offset that depends on
            # the other tensors of the unit (under TP, on this rank's fragment sizes). The
            # library's matmuls on it round by that alignment, so two copies of one matrix
            # (a TP-replicated matrix on each TP rank) would drift apart: step on an aligned copy.
            target.grad = grad.clone()
        try:
            if self._uses_rng:
                with _private_rng(target.device, seed=inner_group.get("step", 0)):
                    inner.step()
            else:
                inner.step()
        finally:
            target.grad = grad
        return self._pack(target, inner.state.pop(target), inner_group["step"])

