"""Shampoo and SOAP for matrix roles plus AdamW for everything else, one optimizer object each.

Owner placement keeps every matrix role whole on one rank, so a single-device matrix
optimizer runs there unchanged: no distributed variant, no communication in ``step()``.
We therefore wrap a published implementation instead of writing our own.

Library choice: ``pytorch_optimizer`` (PyPI ``pytorch-optimizer``, kozistr, Apache-2.0)
---------------------------------------------------------------------------------------
* correctness: its ``SOAP`` follows the reference code of Vyas et al. (arXiv:2409.11321)
  step for step (Adam in the eigenbasis of the two Kronecker factors; ``eigh`` at start,
  one power iteration + QR every ``precondition_frequency`` steps). Its
  ``ScalableShampoo`` ports Google's ``distributed_shampoo`` (Anil et al.,
  arXiv:2002.09018): blocked Kronecker statistics, inverse p-th roots by coupled Newton
  (or SVD), layer-wise grafting, delayed start, infrequent root computation: the Shampoo
  people actually train with, not the 2018 "SVD every step" variant.
* upkeep: several releases a year, one shared base class and test suite for ~100 optimizers.
* weight: plain eager PyTorch, depends on torch and numpy only; imported lazily (first
  construction), so ``import lightning_matrixfsdp`` neither needs it nor pays its import time.
* speed: per-matrix eager kernels (matmul, eigh, QR, Newton iterations): exactly the work
  an owner of a whole matrix has to do; nothing is compiled, so no warm-up or recompiles.
Not chosen: ``heavyball`` (BSD-2, maintained, likely faster on GPU once compiled, but
compile-first: ``torch.compile(mode="max-autotune...")`` on the step path, ``numpy>=2.3``,
a multi-tensor state layout, and no plain Shampoo, only KL-Shampoo/PSGD variants); Meta's
``distributed_shampoo`` (not on PyPI, and its distributed machinery is what owner
placement makes unnecessary); ``torch-optimizer`` (unmaintained since 2021).

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
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from .tail import TailOptimizer, as_float, check_adamw_group, check_nonneg, is_matrix_role, scalar_dtype

__all__ = ["LIBRARY_REQUIREMENT", "SOAP", "Shampoo", "is_matrix_role"]

#: pip requirement of the wrapped library.
LIBRARY_REQUIREMENT = "pytorch-optimizer>=3.6"
_LIBRARY = "pytorch_optimizer"

_GRAFT_TYPES = ("none", "sgd", "adagrad", "rmsprop", "sqrtn")  # LayerWiseGrafting order
_PRECONDITIONER_TYPES = ("all", "input", "output")  # PreConditionerType order
_SCALARS = (int, float, bool, str, type(None))

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


class _MatrixLibraryOptimizer(TailOptimizer):
    """A library matrix optimizer (per parameter) on matrix roles, AdamW on the rest."""

    _library_name: ClassVar[str]
    #: group keys handed to the library constructor under the same names
    _matrix_keys: ClassVar[tuple[str, ...]]
    _group_level_keys: ClassVar[dict[str, frozenset[str]]] = {}
    #: the library draws random numbers in step(): give it a private, per-matrix seeded stream
    _uses_rng: ClassVar[bool] = False

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

    # -------------------------------------------------------------------- step

    def _begin_step(self) -> None:
        """Forget objects of parameters no longer optimized here (e.g. dropped by routing)."""
        cache = self.__dict__.get("_object_cache")
        if cache:
            live = {id(p) for g in self.param_groups for p in g["params"]}
            for p in [p for p in cache if id(p) not in live]:
                del cache[p]

    def _matrix_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """The library's step, for each matrix alone, on its flat state."""
        inner = self._inner(self._library_kwargs(group))
        inner_group = inner.param_groups[0]
        placeholder = inner_group["params"]
        try:
            for p in params:
                flat = self.state[p]
                inner_group["params"] = [p]
                inner.state.clear()
                if flat:
                    inner_group["step"] = int(flat["step"].item())
                    inner.state[p] = self._unpack(p, flat, inner)
                else:  # first step: no "step" key, so every library version initializes p
                    inner_group.pop("step", None)
                if self._uses_rng:
                    with _private_rng(p.device, seed=inner_group.get("step", 0)):
                        inner.step()
                else:
                    inner.step()
                self.state[p] = self._pack(p, inner.state.pop(p), inner_group["step"])
        finally:
            inner_group["params"] = placeholder
            inner_group.pop("step", None)
            inner.state.clear()


class SOAP(_MatrixLibraryOptimizer):
    """SOAP (``pytorch_optimizer.SOAP``) on matrix roles, AdamW on the rest; no communication.

    Args:
        params: parameters or param groups (a group may override any default).
        lr, betas, shampoo_beta, weight_decay, precondition_frequency, max_precondition_dim,
            correct_bias, normalize_gradient, eps: as ``pytorch_optimizer.SOAP`` (same
            defaults). ``shampoo_beta=None`` uses ``betas[1]``; factors of a dimension larger
            than ``max_precondition_dim`` are left out (identity). The library's
            ``merge_dims``/``precondition_1d``/``data_format`` only concern non-2D tensors,
            which never reach it here, so they are not exposed.
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr`` (follows schedulers).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
    """

    _library_name = "SOAP"
    _matrix_keys = ("lr", "betas", "shampoo_beta", "weight_decay", "precondition_frequency",
                    "max_precondition_dim", "correct_bias", "normalize_gradient", "eps")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        weight_decay: float = 1e-2,
        precondition_frequency: int = 10,
        max_precondition_dim: int = 10000,
        correct_bias: bool = True,
        normalize_gradient: bool = False,
        eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        super().__init__(params, {
            "lr": lr, "betas": tuple(betas), "shampoo_beta": shampoo_beta, "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency, "max_precondition_dim": max_precondition_dim,
            "correct_bias": correct_bias, "normalize_gradient": normalize_gradient, "eps": eps,
            "adamw_lr": adamw_lr, "adamw_betas": tuple(adamw_betas), "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        })


class Shampoo(_MatrixLibraryOptimizer):
    """Shampoo (``pytorch_optimizer.ScalableShampoo``) on matrix roles, AdamW on the rest.

    Blocked Kronecker-factored preconditioning with layer-wise grafting, as in Google's
    ``distributed_shampoo``; every matrix is whole on its owner, so no communication.
    The library's power iteration (``use_svd=False``) draws its start vector from a private
    generator seeded with the matrix's step count: the global RNG is left alone and a
    matrix's update does not depend on which other matrices its rank owns.

    Args:
        params: parameters or param groups (a group may override any default).
        lr, betas, moving_average_for_momentum, weight_decay, decoupled_weight_decay,
            decoupled_learning_rate, nesterov, start_preconditioning_step,
            preconditioning_compute_steps, statistics_compute_steps, block_size,
            inverse_exponent_override, skip_preconditioning_rank_lt,
            no_preconditioning_for_layers_with_dim_gt, diagonal_eps, matrix_eps, use_svd:
            as ``pytorch_optimizer.ScalableShampoo`` (same defaults). ``betas[0]`` is the
            momentum, ``betas[1]`` the statistics' decay; before
            ``start_preconditioning_step`` the grafted update is used alone.
        shape_interpretation: the library's dimension merging. Default ``False`` here (the
            library's is ``True``): for a 2D matrix it can only merge both dimensions into
            one, which turns preconditioning off for any matrix with at most ``block_size``
            elements.
        graft_type: update-size reference: "sgd" (default), "adagrad", "rmsprop", "sqrtn",
            "none" (or the library's ``LayerWiseGrafting`` value).
        pre_conditioner_type: "all" (default), "input" or "output" (or ``PreConditionerType``).
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr`` (follows schedulers).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
    """

    _library_name = "ScalableShampoo"
    _uses_rng = True  # power iteration in the coupled-Newton inverse root
    _matrix_keys = ("lr", "betas", "moving_average_for_momentum", "weight_decay", "decoupled_weight_decay",
                    "decoupled_learning_rate", "nesterov", "start_preconditioning_step",
                    "preconditioning_compute_steps", "statistics_compute_steps", "block_size",
                    "inverse_exponent_override", "skip_preconditioning_rank_lt",
                    "no_preconditioning_for_layers_with_dim_gt", "shape_interpretation", "graft_type",
                    "pre_conditioner_type", "diagonal_eps", "matrix_eps", "use_svd")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        moving_average_for_momentum: bool = False,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        decoupled_learning_rate: bool = True,
        nesterov: bool = True,
        start_preconditioning_step: int = 25,
        preconditioning_compute_steps: int = 1000,
        statistics_compute_steps: int = 1,
        block_size: int = 512,
        inverse_exponent_override: int = 0,
        skip_preconditioning_rank_lt: int = 1,
        no_preconditioning_for_layers_with_dim_gt: int = 8192,
        shape_interpretation: bool = False,
        graft_type: str | int = "sgd",
        pre_conditioner_type: str | int = "all",
        diagonal_eps: float = 1e-10,
        matrix_eps: float = 1e-6,
        use_svd: bool = False,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        super().__init__(params, {
            "lr": lr, "betas": tuple(betas), "moving_average_for_momentum": moving_average_for_momentum,
            "weight_decay": weight_decay, "decoupled_weight_decay": decoupled_weight_decay,
            "decoupled_learning_rate": decoupled_learning_rate, "nesterov": nesterov,
            "start_preconditioning_step": start_preconditioning_step,
            "preconditioning_compute_steps": preconditioning_compute_steps,
            "statistics_compute_steps": statistics_compute_steps, "block_size": block_size,
            "inverse_exponent_override": inverse_exponent_override,
            "skip_preconditioning_rank_lt": skip_preconditioning_rank_lt,
            "no_preconditioning_for_layers_with_dim_gt": no_preconditioning_for_layers_with_dim_gt,
            "shape_interpretation": shape_interpretation, "graft_type": graft_type,
            "pre_conditioner_type": pre_conditioner_type, "diagonal_eps": diagonal_eps,
            "matrix_eps": matrix_eps, "use_svd": use_svd,
            "adamw_lr": adamw_lr, "adamw_betas": tuple(adamw_betas), "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        })

    def _library_kwargs(self, group: dict[str, Any]) -> dict[str, Any]:
        """Enum names (CLI-friendly strings) -> the library's integer enum values."""
        kwargs = super()._library_kwargs(group)
        kwargs["graft_type"] = _enum_index("graft_type", kwargs["graft_type"], _GRAFT_TYPES)
        kwargs["pre_conditioner_type"] = _enum_index(
            "pre_conditioner_type", kwargs["pre_conditioner_type"], _PRECONDITIONER_TYPES)
        return kwargs


def _enum_index(what: str, value: str | int, names: tuple[str, ...]) -> int:
    """A name from ``names`` (case-insensitive) or its integer index -> the index."""
    if isinstance(value, str):
        if value.lower() not in names:
            raise ValueError(f"{what} must be one of {names}, got {value!r}")
        return names.index(value.lower())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= int(value) < len(names):
        raise ValueError(f"{what} must be one of {names} or an index below {len(names)}, got {value!r}")
    return int(value)
