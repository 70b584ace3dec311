"""Pure conversions between the checkpoint's representations (no process group, no IO).

* optimizer state keyed by parameter name <-> torch's native id-keyed format;
* DCP metadata -> model entries, per-optimizer state and param-group entries;
* small helpers on specs, dtypes and optimizers shared by save, load and convert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = ["DcpEntries", "dtype_name", "from_native", "hparams", "nest", "optimizer_class", "parse_dcp",
           "placeholder", "spec", "to_native", "unwrap_optimizer"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def spec(v: Any) -> tuple:
    """("t", shape, dtype) for a tensor, ("o",) for any other object."""
    return ("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("o",)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """A ``LightningOptimizer``'s torch optimizer (any other optimizer as it is)."""
    inner = getattr(optimizer, "optimizer", None)  # LightningOptimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def optimizer_class(optimizer: Any) -> str:
    """The qualified class name the sidecar records for an optimizer."""
    t = type(unwrap_optimizer(optimizer))
    return f"{t.__module__}.{t.__qualname__}"


def hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group without its parameters."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


# ---------------------------------------------------------------------- native optimizer state
def to_native(state: Mapping[str, Mapping[str, Any]], hparams_of: Sequence[Mapping[str, Any]],
              groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """fqn-keyed optimizer state -> torch's ``Optimizer.state_dict()`` format (ids, with ``param_names``)."""
    out_state: dict[int, Any] = {}
    out_groups = []
    i = 0
    for hp, names in zip(hparams_of, groups):
        ids = []
        for n in names:
            if n in state:
                out_state[i] = dict(state[n])
            ids.append(i)
            i += 1
        out_groups.append({**hp, "params": ids, "param_names": list(names)})
    return {"state": out_state, "param_groups": out_groups}


def from_native(native: Mapping[str, Any], names: Optional[Sequence[Sequence[str]]] = None
                ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """torch's native optimizer state -> (groups with fqn ``params``, fqn-keyed state).

    Names come from each group's ``param_names`` or, failing that, from ``names``
    (the current optimizer's groups in model order, the order this package writes)."""
    try:
        saved_groups = list(native["param_groups"])
        saved_state = native["state"]
    except (KeyError, TypeError):
        raise CheckpointCorruptError("optimizer state has no 'state'/'param_groups' entries") from None
    has_names = all("param_names" in g for g in saved_groups)
    if not has_names:
        if names is None or [len(g["params"]) for g in saved_groups] != [len(n) for n in names]:
            raise CheckpointMismatchError(
                "cannot map this checkpoint's optimizer state to parameters: its param groups carry no "
                "'param_names' and their sizes "
                f"{[len(g['params']) for g in saved_groups]} differ from the current optimizer's "
                f"{[len(n) for n in names] if names is not None else '?'}")
    groups, state = [], {}
    for j, g in enumerate(saved_groups):
        fq = list(g["param_names"]) if has_names else list(names[j])  # type: ignore[index]
        for pid, n in zip(g["params"], fq):
            if pid in saved_state:
                state[n] = saved_state[pid]
        groups.append({**hparams(g), "params": fq})
    return groups, state


def nest(pairs: Iterable[tuple[tuple, Any]]) -> dict[str, Any]:
    """Rebuild an optimizer state dict from (path, value) pairs (lists come back as lists)."""
    root: dict[Any, Any] = {}
    for p, v in pairs:
        d = root
        for part in p[:-1]:
            d = d.setdefault(part, {})
        d[p[-1]] = v

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            x = {k: fix(v) for k, v in x.items()}
            keys = list(x)
            if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
                return [x[k] for k in range(len(keys))]
        return x

    return {str(k): fix(v) for k, v in root.items()}


# ---------------------------------------------------------------------- DCP keys
@dataclass
class DcpEntries:
    """A DCP checkpoint's metadata split by what each entry is."""

    model: dict[str, tuple[str, Any]] = field(default_factory=dict)               # key -> (flat key, metadata)
    # optimizer i -> fqn -> [(state key path, flat key, metadata)]
    state: dict[int, dict[str, list[tuple[tuple, str, Any]]]] = field(default_factory=dict)
    groups: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)   # i -> j -> hparam -> flat
    meta: Mapping[str, Any] = field(default_factory=dict)                        # flat key -> DCP metadata

    def specs(self) -> dict[str, tuple]:
        """The model entries as ``spec`` tuples."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {k: (("t", tuple(m.size), m.properties.dtype) if isinstance(m, TensorStorageMetadata) else ("o",))
                for k, (_, m) in self.model.items()}

    def n_optimizers(self) -> int:
        return 1 + max(self.groups.keys() | self.state.keys(), default=-1)


def parse_dcp(md: Any, known: Sequence[str]) -> DcpEntries:
    """Split DCP metadata into model entries and per-optimizer state / param-group entries.

    ``known``: the model's keys, to split flat keys when the metadata carries no planner data."""
    out = DcpEntries(meta=md.state_dict_metadata)
    pdata = md.planner_data if isinstance(getattr(md, "planner_data", None), dict) else {}
    known_sorted = sorted(known, key=len, reverse=True)
    for flat, m in md.state_dict_metadata.items():
        path = pdata.get(flat)
        if not isinstance(path, tuple):
            path = _guess_path(flat, known_sorted)
        if not path:
            continue
        head = str(path[0])
        if head == "state_dict" and len(path) == 2:
            out.model[str(path[1])] = (flat, m)
            continue
        mo = re.fullmatch(r"optimizer_(\d+)", head)
        if not mo or len(path) < 3:
            continue
        i = int(mo.group(1))
        if path[1] == "state" and len(path) >= 4:
            out.state.setdefault(i, {}).setdefault(str(path[2]), []).append((tuple(path[3:]), flat, m))
        elif path[1] == "param_groups" and len(path) == 4:
            out.groups.setdefault(i, {}).setdefault(int(path[2]), {})[str(path[3])] = flat
    return out


def _guess_path(flat: str, known_sorted: Sequence[str]) -> Optional[tuple]:
    """Without planner data, split a flat DCP key using the module's keys."""
    if flat.startswith("state_dict."):
        return ("state_dict", flat[len("state_dict."):])
    head, _, rest = flat.partition(".")
    if not head.startswith("optimizer_"):
        return None
    if rest.startswith("state."):
        rest = rest[len("state."):]
        for k in known_sorted:
            if rest.startswith(k + "."):
                return (head, "state", k, rest[len(k) + 1:])  # state keys may hold dots ("name.i")
        return None
    parts = rest.split(".")
    if len(parts) == 3 and parts[0] == "param_groups" and parts[1].isdigit():
        return (head, "param_groups", int(parts[1]), parts[2])
    return None


def placeholder(m: Any) -> Optional[torch.Tensor]:
    """What DCP loads an entry into: a CPU tensor of the saved size and dtype, or ``None`` for objects."""
    size = getattr(m, "size", None)
    return torch.empty(tuple(size), dtype=m.properties.dtype) if size is not None else None
