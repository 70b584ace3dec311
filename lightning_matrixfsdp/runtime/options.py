"""Option checks for ``matrix_shard`` and the strategies: normalize, or refuse clearly.

Pure functions, no communication: ``MatrixFSDPConfig`` (``config.py``) runs them when it
is built, at the strategy's construction or before ``matrix_shard`` touches the model, so a wrong option fails where it was
written, not at setup in a frame of PyTorch's (``'int' object is not iterable``, a
module class called as a policy). Every error names the option, the value given and
what is accepted.

Accepted forms of the two module policies (YAML configs give strings):

- ``wrap_policy``: ``None``, an ``nn.Module`` class, a dotted import path of one
  (``"pkg.module.Block"``), a set/frozenset/list/tuple of classes or paths, or a
  callable ``(name, module) -> bool``;
- ``activation_checkpointing_policy``: the same, with a callable ``(module) -> bool``.

Both normalize to ``None``, a ``set`` of classes, or the callable.
"""

from __future__ import annotations

import importlib
import inspect
import operator
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_matrixfsdp.runtime.comm.collectives import COLLECTIVE_NAMES
from lightning_matrixfsdp.runtime.errors import MatrixShardError  # re-exported: its old home
from lightning_matrixfsdp.runtime.planner import PLANNERS

__all__ = [
    "DTYPE_NAMES",
    "MatrixShardError",
    "check_backend",
    "check_bool",
    "check_checkpointing_policy",
    "check_collective",
    "check_device",
    "check_dtype",
    "check_matrix_filter",
    "check_mesh",
    "check_optimizer_factory",
    "check_planner",
    "check_positive_int",
    "check_timeout",
    "check_wrap_policy",
]


#: Names accepted for ``param_dtype`` / ``reduce_dtype`` (YAML and CLI configs).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
}
_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_CLASSES = ("an nn.Module class, a dotted import path of one ('pkg.module.Block'), "
            "a set/list/tuple of those")
_POLICY_FORMS = {
    "wrap_policy": f"None, {_CLASSES}, or a callable (name, module) -> bool",
    "activation_checkpointing_policy": f"None, {_CLASSES}, or a callable (module) -> bool",
}


def _refuse(name: str, value: Any, accepted: str, why: str = "") -> MatrixShardError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    reason = f": {why}" if why else ""
    return MatrixShardError(f"{name}={shown} ({type(value).__name__}) is not accepted{reason}; "
                            f"expected {accepted}")


# ---------------------------------------------------------------------- module policies
def _import_class(path: str, name: str, accepted: str) -> type:
    """``"pkg.module.Outer.Inner"`` -> the class: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise _refuse(name, path, accepted, "a class is named by its dotted import path, e.g. 'pkg.module.Block'")
    error: Optional[BaseException] = None  # from the longest prefix tried: the likeliest cause
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError as e:
            error = error or e
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            raise _refuse(name, path, accepted, f"cannot import it ({error or e})") from None
        return obj
    raise _refuse(name, path, accepted, f"cannot import it ({error})") from None


def _module_class(item: Any, name: str, accepted: str, whole: Any) -> type:
    obj = _import_class(item, name, accepted) if isinstance(item, str) else item
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj
    if isinstance(item, str):
        why = f"{item!r} names {obj!r}, not an nn.Module class"
    elif isinstance(obj, nn.Module):
        why = f"{type(obj).__name__}(...) is an nn.Module instance; give its class"
    else:
        why = f"{obj!r} ({type(obj).__name__}) is not an nn.Module class"
    raise _refuse(name, whole, accepted, why)


def _takes(fn: Callable[..., Any], n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True where Python cannot tell)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature
        return True
    try:
        sig.bind(*([None] * n))
    except TypeError:
        return False
    return True


def _module_policy(value: Any, name: str, nargs: int) -> Union[None, set[type], Callable[..., bool]]:
    accepted = _POLICY_FORMS[name]
    if value is None:
        return None
    if isinstance(value, (str, type)):  # one class (a class is callable, but not a policy)
        return {_module_class(value, name, accepted, value)}
    if isinstance(value, (set, frozenset, list, tuple)):
        return {_module_class(item, name, accepted, value) for item in value}
    if isinstance(value, nn.Module):
        raise _refuse(name, value, accepted, f"an nn.Module instance; give its class, {type(value).__name__}")
    if callable(value):
        if not _takes(value, nargs):
            args = "(name, module)" if nargs == 2 else "(module)"
            raise _refuse(name, value, accepted, f"the callable cannot be called as {args}")
        return value
    raise _refuse(name, value, accepted)


def check_wrap_policy(value: Any) -> Union[None, set[type], Callable[[str, nn.Module], bool]]:
    """``wrap_policy`` as ``None``, a set of ``nn.Module`` classes, or a ``(name, module)`` callable."""
    return _module_policy(value, "wrap_policy", 2)


def check_checkpointing_policy(value: Any) -> Union[None, set[type], Callable[[nn.Module], bool]]:
    """``activation_checkpointing_policy`` as ``None``, a set of classes, or a ``(module)`` callable."""
    return _module_policy(value, "activation_checkpointing_policy", 1)


# ---------------------------------------------------------------------- callables and names
def check_matrix_filter(value: Any) -> Optional[Callable[[str, nn.Parameter], bool]]:
    accepted = "None or a callable (fqn, param) -> bool"
    if value is None:
        return None
    if isinstance(value, type):
        raise _refuse("matrix_filter", value, accepted, "a class, not a filter function")
    if isinstance(value, nn.Module) or not callable(value):
        raise _refuse("matrix_filter", value, accepted)
    if not _takes(value, 2):
        raise _refuse("matrix_filter", value, accepted, "the callable cannot be called as (fqn, param)")
    return value


def check_planner(value: Any) -> Union[str, Callable[..., Any]]:
    accepted = f"one of {', '.join(map(repr, PLANNERS))} or a callable (units, world) -> Plan"
    if isinstance(value, str):
        if value not in PLANNERS:
            raise _refuse("planner", value, accepted, f"unknown planner {value!r}")
        return value
    if isinstance(value, (type, nn.Module)) or not callable(value):
        raise _refuse("planner", value, accepted)
    if not _takes(value, 2):
        raise _refuse("planner", value, accepted, "the callable cannot be called as (units, world)")
    return value


def check_collective(value: Any) -> str:
    names = ("auto", *COLLECTIVE_NAMES)  # "auto": chosen from the topology in matrix_shard (runtime/mesh/topology.py)
    accepted = f"one of {', '.join(map(repr, names))}"
    if not isinstance(value, str):
        raise _refuse("collective", value, accepted)
    if value not in names:
        raise _refuse("collective", value, accepted, f"unknown collective {value!r}")
    return value


def check_optimizer_factory(value: Any) -> Optional[Callable[..., Any]]:
    accepted = ("None or a callable params -> Optimizer, e.g. functools.partial(lightning_matrixfsdp.Muon, "
                "lr=0.02) or an optimizer class")
    if value is None:
        return None
    if isinstance(value, torch.optim.Optimizer):
        raise _refuse("optimizer", value, accepted, "an optimizer instance; the strategy builds the optimizer "
                      "over the sharded parameters itself")
    if isinstance(value, nn.Module):
        raise _refuse("optimizer", value, accepted, "an nn.Module, not an optimizer factory")
    if isinstance(value, type) and not issubclass(value, torch.optim.Optimizer):
        raise _refuse("optimizer", value, accepted, f"the class {value.__name__} is not a torch.optim.Optimizer")
    if not callable(value):
        raise _refuse("optimizer", value, accepted)
    if not _takes(value, 1):
        raise _refuse("optimizer", value, accepted, "the callable cannot be called with the parameters alone")
    return value


# ---------------------------------------------------------------------- values
def check_dtype(value: Any, name: str) -> Optional[torch.dtype]:
    """``param_dtype`` / ``reduce_dtype``: ``None``, a floating ``torch.dtype`` or its name."""
    accepted = (f"None, torch.bfloat16/float16/float32/float64, or one of the names "
                f"{', '.join(map(repr, DTYPE_NAMES))}")
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value not in _FLOATING:
            raise _refuse(name, value, accepted, "not a floating dtype the runtime computes and reduces in")
        return value
    if isinstance(value, str):
        key = value.replace("torch.", "", 1)
        if key not in DTYPE_NAMES:
            raise _refuse(name, value, accepted, "not a dtype name")
        return DTYPE_NAMES[key]
    raise _refuse(name, value, accepted)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _refuse(name, value, "True or False")
    return value


def check_bool_or_auto(value: Any, name: str) -> Union[bool, str]:
    """``True``, ``False`` or ``"auto"`` (chosen from the topology in ``matrix_shard``)."""
    if value == "auto" and isinstance(value, str):
        return value
    if not isinstance(value, bool):
        raise _refuse(name, value, "True, False or 'auto'")
    return value


def check_positive_int(value: Any, name: str, *, optional: bool = False) -> Optional[int]:
    accepted = ("None or " if optional else "") + "a positive int"
    if value is None and optional:
        return None
    if isinstance(value, bool):
        raise _refuse(name, value, accepted)
    try:
        n = operator.index(value)  # ints and integer-like scalars (numpy), not floats or strings
    except TypeError:
        raise _refuse(name, value, accepted) from None
    if n < 1:
        raise _refuse(name, value, accepted, "must be at least 1")
    return n


def check_timeout(value: Any) -> Optional[timedelta]:
    accepted = "None or a positive datetime.timedelta, e.g. timedelta(minutes=30)"
    if value is None:
        return None
    if not isinstance(value, timedelta):
        raise _refuse("timeout", value, accepted)
    if value <= timedelta(0):
        raise _refuse("timeout", value, accepted, "must be positive")
    return value


def check_device(value: Any) -> Optional[torch.device]:
    accepted = "None, a torch.device, or a device string such as 'cpu' or 'cuda:0'"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise _refuse("device", value, accepted)
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError) as e:
        raise _refuse("device", value, accepted, str(e).splitlines()[0]) from None


def check_backend(value: Any) -> Optional[str]:
    """``None`` (Lightning's choice for the device), a backend torch.distributed knows (the built-in
    ones and any registered with ``Backend.register_backend``: import its package first), or the
    per-device form ``"cpu:gloo,cuda:nccl"``."""
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    accepted = (f"None, a torch.distributed backend ({', '.join(map(repr, known))}; a third-party one once its "
                "package registered it) or the per-device form 'cpu:gloo,cuda:nccl'")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _refuse("process_group_backend", value, accepted)
    names = [part.split(":", 1)[1] if ":" in part else part for part in value.split(",")]
    bad = [n for n in names if n.strip().lower() not in known]
    if bad:
        raise _refuse("process_group_backend", value, accepted, f"unknown backend {bad[0].strip()!r}")
    return value


def check_mesh(value: Any) -> Any:
    accepted = "None or a 1-D (shard) or 2-D (replicate, shard) torch.distributed DeviceMesh"
    if value is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(value, DeviceMesh):
        raise _refuse("mesh", value, accepted)
    return value
