"""Checkpoint IO for owner-sharded models: DCP with a layout sidecar, resharding load, consolidated export.

Why this module exists: under owner placement a rank holds a parameter either
whole or as an empty placeholder, and its optimizer holds state only for what it
owns.  Lightning's inherited paths would save the placeholders (data loss) or
collide inside DCP (same key, different sizes).  Here every tensor is written
once, whole, by its owner, keyed by its fully qualified name (fqn), so a
checkpoint does not depend on the world size or the plan that wrote it.

Formats (see ``docs/checkpointing.md``):

* *distributed* (a directory): ``torch.distributed.checkpoint`` of
  ``{"state_dict": {fqn: tensor}, "optimizer_<i>": {"state": {fqn: {name: value}},
  "param_groups": [{..., "params": [fqn, ...]}]}}``, the layout Lightning's
  ``ModelParallelStrategy`` writes, plus ``meta.pt`` (loops, schedulers,
  callbacks) and the JSON layout sidecar ``matrix_fsdp_layout.json``.
* *consolidated* (one file): an ordinary Lightning checkpoint with full tensors;
  optimizer states in torch's native format (integer ids) with ``param_names``.

Loading accepts both, plus a plain ``state_dict`` file and a DCP directory written
by ``ModelParallelStrategy`` + FSDP2.  Each rank reads only the tensors it owns
under the *current* plan, so any world size, shard span or planner can resume.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.state import STATE_ATTR

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointKeyError", "CheckpointMismatchError",
    "SIDECAR_NAME", "from_native", "load", "load_sharded", "load_weights", "module_state_dict", "optimizer_state_dict",
    "read_sidecar", "save", "save_sharded", "sharded_model_state_dict", "sharded_optimizer_state_dict", "to_native",
]

SIDECAR_NAME = "matrix_fsdp_layout.json"
META_NAME = "meta.pt"  # Lightning's marker of a sharded checkpoint directory (fabric.utilities.load._METADATA_FILENAME)
FORMAT = "lightning_matrixfsdp.checkpoint"
FORMAT_VERSION = 1
PARTIAL_PREFIX = ".mfsdp-partial-"
OLD_PREFIX = ".mfsdp-old-"
# Group keys that do not tell optimizers apart: names, the scheduler's mark, and the flags
# torch's ``Optimizer.__setstate__`` fills in with defaults when a state is loaded.
_IGNORED_GROUP_KEYS = ("params", "param_names", "initial_lr", "differentiable", "foreach", "fused", "capturable",
                       "maximize")
PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------- errors
class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised here (raised on all ranks alike)."""


class CheckpointKeyError(CheckpointError):
    """Missing or unexpected model keys / optimizer entries under ``strict_loading=True``."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model: shapes, dtypes, another model, another optimizer."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint is unreadable or incomplete: bad sidecar, missing DCP metadata, partial save."""


_ERRORS = {c.__name__: c for c in (CheckpointError, CheckpointKeyError, CheckpointMismatchError,
                                     CheckpointCorruptError, FileNotFoundError, IsADirectoryError)}


# ---------------------------------------------------------------------- process helpers
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    """Where collectives want their tensors: the current GPU under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_object(obj: Any) -> list[Any]:
    rank, size = _world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def _broadcast_object(obj: Any) -> Any:
    if _world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _world()[1] > 1:
        dist.all_reduce(torch.zeros(1, device=_comm_device()))


def _agree(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on every rank; if it fails anywhere, raise on every rank (never leave peers hanging)."""
    err: Optional[BaseException] = None
    out = None
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised below, on all ranks
        err = e
    if _world()[1] > 1:
        flags = _all_gather_object(None if err is None else (type(err).__name__, str(err)))
        failed = [(r, f) for r, f in enumerate(flags) if f is not None]
        if failed and err is None:
            r, (name, msg) = failed[0]
            raise _ERRORS.get(name, CheckpointError)(f"{msg} (raised on rank {r})")
    if err is not None:
        raise err
    return out


def _warn(msg: str) -> None:
    if _world()[0] == 0:
        warnings.warn(msg, UserWarning, stacklevel=3)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer


# ---------------------------------------------------------------------- the model's keys
@dataclass
class _Entry:
    """One tensor of the module's ``state_dict`` as this rank sees it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: Optional[int]            # shard-group rank of the owner; None: replicated on every rank
    owner_global: Optional[int]     # global rank of that owner in this rank's shard group
    local: Optional[torch.Tensor]   # the data this rank holds (owned or replicated), else None
    primary: str                    # first key of the same tensor (tied weights share one)
    role: Optional[str] = None


@dataclass
class _Index:
    entries: "OrderedDict[str, _Entry]"
    extra: dict[str, Any]                       # non-tensor state (``get_extra_state``)
    order: dict[str, int]
    key_of: dict[int, str]                      # id(parameter) -> primary key
    in_group0: bool                             # this rank belongs to global rank 0's shard group
    roots: list[tuple[str, Any]] = field(default_factory=list)  # (prefix, MatrixFSDPState)

    def key(self, p: torch.Tensor) -> str:
        try:
            return self.key_of[id(p)]
        except KeyError:
            raise CheckpointError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not part of the module; "
                "checkpointing needs every optimized parameter to be registered in the LightningModule"
            ) from None

    def mine(self, key: str) -> bool:
        return self.entries[self.entries[key].primary].local is not None


def _index(module: nn.Module) -> _Index:
    """Map the module's ``state_dict`` keys to owners, shapes and this rank's tensors."""
    names: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    reg: dict[str, tuple[Any, Any]] = {}
    roots = []
    for prefix, root in module.named_modules():
        st = getattr(root, STATE_ATTR, None)
        if st is None:
            continue
        roots.append((prefix, st))
        for sp in st.params:
            for m, pname in sp.registrations:
                for mname in names.get(id(m), []):
                    reg[_join(mname, pname)] = (sp, st)
    rank = _world()[0]
    in_group0 = all(0 in st.sg.global_ranks for _, st in roots) if roots else rank == 0
    entries: OrderedDict[str, _Entry] = OrderedDict()
    extra: dict[str, Any] = {}
    first: dict[int, str] = {}
    key_of: dict[int, str] = {}
    for key, v in module.state_dict(keep_vars=True).items():
        if key in reg:
            sp, st = reg[key]
            primary = first.setdefault(id(sp.resident), key)
            key_of[id(sp.resident)] = primary
            entries[key] = _Entry(key, tuple(sp.shard.shape), sp.resident.dtype, sp.shard.owner,
                                  st.sg.g(sp.shard.owner), sp.resident.detach() if sp.owned else None, primary,
                                  sp.shard.role.value)
        elif isinstance(v, torch.Tensor):
            primary = first.setdefault(id(v), key)
            key_of[id(v)] = primary
            entries[key] = _Entry(key, tuple(v.shape), v.dtype, None, None, v.detach(), primary)
        else:
            extra[key] = v
    order = {k: i for i, k in enumerate(list(entries) + list(extra))}
    return _Index(entries, extra, order, key_of, in_group0, roots)


# ---------------------------------------------------------------------- state dicts
def sharded_model_state_dict(module: nn.Module, full: bool = False) -> dict[str, Any]:
    """``full=False``: this rank's owned and replicated tensors (for DCP).  ``full=True``: the whole
    state on rank 0 (CPU), streamed from the owners one tensor at a time; ``{}`` elsewhere.
    Collective when ``full=True``: call it on every rank."""
    index = _index(module)
    if not full:
        out: dict[str, Any] = {k: e.local for k, e in index.entries.items() if e.primary == k and e.local is not None}
        out.update(index.extra)
        return out
    rank = _world()[0]
    device = _comm_device()
    got: dict[str, torch.Tensor] = {}
    for key, e in index.entries.items():
        if e.primary != key:
            continue
        if e.owner is None:
            t = e.local.cpu() if rank == 0 else None
        else:
            t = _to_rank0(e.local, e.shape, e.dtype, e.owner_global, index.in_group0, device)
        if rank == 0:
            got[key] = t  # type: ignore[assignment]
    if rank != 0:
        return {}
    return {k: (got[index.entries[k].primary] if k in index.entries else index.extra[k]) for k in index.order}


def _to_rank0(local: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, src: Optional[int],
              in_group0: bool, device: torch.device) -> Optional[torch.Tensor]:
    """Move one tensor from its owner ``src`` (a global rank) to rank 0's CPU; bounded memory."""
    rank = _world()[0]
    if not in_group0 or src is None:
        return None
    if src == rank:
        if rank == 0:
            assert local is not None
            return local.cpu()
        assert local is not None
        dist.send(local.to(device).contiguous(), dst=0)
        return None
    if rank == 0:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.recv(buf, src=src)
        return buf.cpu()
    return None


def _hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _full_groups(index: _Index, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every param group's keys over all ranks (routing left each rank its owned ones), in model order."""
    local = _agree(lambda: [[index.key(p) for p in g["params"]] for g in optimizer.param_groups])
    merged: list[set[str]] = [set() for _ in local]
    for groups in _all_gather_object(local):
        if len(groups) != len(merged):
            raise CheckpointError("ranks disagree on the number of optimizer param groups")
        for s, g in zip(merged, groups):
            s.update(g)
    return [sorted(s, key=index.order.__getitem__) for s in merged]


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                                 full: bool = False) -> dict[str, Any]:
    """Optimizer state keyed by parameter fqn (``full=False``, this rank's params, for DCP) or
    torch's native id-keyed format on rank 0 (``full=True``, with ``param_names``).  Collective."""
    optimizer = _unwrap(optimizer)
    index = _index(module)
    groups = _full_groups(index, optimizer)
    if not full:
        state = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                key = index.key(p)
                if p in optimizer.state and index.mine(key):
                    state[key] = {n: (v.detach() if isinstance(v, torch.Tensor) else v)
                                  for n, v in optimizer.state[p].items()}
        return {"state": state,
                "param_groups": [{**_hparams(g), "params": list(f)} for g, f in zip(optimizer.param_groups, groups)]}
    rank = _world()[0]
    params_of: dict[str, torch.Tensor] = {}
    desc: dict[str, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            key = index.key(p)
            e = index.entries[key]
            mine = e.local is not None if e.owner is not None else rank == 0
            if mine and p in optimizer.state:
                params_of[key] = p
                desc[key] = {n: ("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("o", v)
                             for n, v in optimizer.state[p].items()}
    sources: dict[str, tuple[int, dict[str, Any]]] = {}
    for r, in0, d in _all_gather_object((rank, index.in_group0, desc)):
        for key, spec in d.items():
            if in0 and key not in sources:
                sources[key] = (r, spec)
    device = _comm_device()
    state: dict[str, dict[str, Any]] = {}
    for key in sorted(sources, key=index.order.__getitem__):
        src, spec = sources[key]
        for name, s in spec.items():
            if s[0] == "o":
                value = s[1]
            else:
                local = optimizer.state[params_of[key]][name] if src == rank else None
                value = _to_rank0(local, s[1], s[2], src, index.in_group0, device)
            if rank == 0:
                state.setdefault(key, {})[name] = value
    if rank != 0:
        return {}
    return to_native(state, [_hparams(g) for g in optimizer.param_groups], groups)


def to_native(state: Mapping[str, Mapping[str, Any]], hparams: Sequence[Mapping[str, Any]],
              groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """fqn-keyed optimizer state -> torch's ``Optimizer.state_dict()`` format (ids, with ``param_names``)."""
    out_state: dict[int, Any] = {}
    out_groups = []
    i = 0
    for hp, names in zip(hparams, groups):
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
        groups.append({**_hparams(g), "params": fq})
    return groups, state


# ---------------------------------------------------------------------- the layout sidecar
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": str(torch.__version__)}
    for dist_name, key in (("lightning-matrixfsdp", "lightning_matrixfsdp"), ("lightning", "lightning")):
        try:
            out[key] = version(dist_name)
        except PackageNotFoundError:
            pass
    return out


def layout_dict(index: _Index, optimizers: Sequence[Mapping[str, Any]] = (), classes: Sequence[str] = ()
                ) -> dict[str, Any]:
    """What the sidecar records: who owned what, shapes, dtypes, plans, optimizers, versions."""
    world = _world()[1]
    plans = [{"prefix": p, "digest": st.plan.digest(), "plan": st.plan.to_dict()} for p, st in index.roots]
    first = index.roots[0][1] if index.roots else None
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": world,
        "shard_span": first.sg.size if first else 1,
        "replicate": first.replicate_size if first else world,
        "planner": first.plan.planner if first else None,
        "plans": plans,
        "params": {k: {"shape": list(e.shape), "dtype": _dtype_name(e.dtype), "owner": e.owner, "role": e.role,
                       **({"alias_of": e.primary} if e.primary != k else {})}
                   for k, e in index.entries.items()},
        "optimizers": [{"class": c,
                        "param_groups": [list(g.get("param_names", g["params"])) for g in o.get("param_groups", [])]}
                       for c, o in zip(list(classes) + [None] * len(optimizers), optimizers)],
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_sidecar(path: Path) -> dict[str, Any]:
    """Parse and check the sidecar; any defect is a :class:`CheckpointCorruptError`."""
    f = path / SIDECAR_NAME
    try:
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(f"layout sidecar {f} is corrupted or unreadable: {e}") from None
    problems = []
    if not isinstance(d, dict):
        problems.append("not a JSON object")
    else:
        if d.get("format") != FORMAT:
            problems.append(f"format {d.get('format')!r} is not {FORMAT!r}")
        v = d.get("format_version")
        if not isinstance(v, int) or v > FORMAT_VERSION:
            problems.append(f"format_version {v!r} is not supported (this package reads <= {FORMAT_VERSION})")
        for k in ("world_size", "shard_span"):
            if not isinstance(d.get(k), int) or d[k] < 1:
                problems.append(f"{k} {d.get(k)!r} is not a positive integer")
        params = d.get("params")
        if not isinstance(params, dict):
            problems.append("'params' is missing")
        else:
            for k, p in params.items():
                if not (isinstance(p, dict) and isinstance(p.get("shape"), list) and isinstance(p.get("dtype"), str)):
                    problems.append(f"entry {k!r} has no shape/dtype")
                    break
    if problems:
        raise CheckpointCorruptError(f"layout sidecar {f} is corrupted: " + "; ".join(problems))
    return d


# ---------------------------------------------------------------------- save
def save_sharded(module: nn.Module, path: PathLike, optimizers: Iterable[torch.optim.Optimizer] = (),
                 full: bool = False, extra: Optional[Mapping[str, Any]] = None) -> None:
    """Save outside Lightning: the module, the optimizers and ``extra`` (goes to ``meta.pt``). Collective."""
    optimizers = [_unwrap(o) for o in optimizers]
    checkpoint = dict(extra or {})
    checkpoint["state_dict"] = sharded_model_state_dict(module, full)
    checkpoint["optimizer_states"] = [sharded_optimizer_state_dict(module, o, full) for o in optimizers]
    write_checkpoint(module, checkpoint, path, full, [_class_name(o) for o in optimizers])


def _class_name(o: Any) -> str:
    t = type(_unwrap(o))
    return f"{t.__module__}.{t.__qualname__}"


def write_checkpoint(module: nn.Module, checkpoint: Mapping[str, Any], path: PathLike, full: bool,
                     optimizer_classes: Sequence[str] = ()) -> None:
    """Write what ``sharded_model_state_dict`` / ``sharded_optimizer_state_dict`` produced, crash-safely.

    Everything goes to a hidden temporary sibling (``.mfsdp-partial-<token>``) first;
    only when every rank has finished does rank 0 rename it to ``path``."""
    rank = _world()[0]
    path = Path(_broadcast_object(str(path)))
    token = _broadcast_object(secrets.token_hex(8))
    tmp = path.parent / f"{PARTIAL_PREFIX}{token}"
    checkpoint = dict(checkpoint)
    if full:
        def _write_file() -> None:
            if rank != 0:
                return
            if path.is_dir() and not (path / META_NAME).is_file():
                raise IsADirectoryError(f"the checkpoint path exists and is a directory: {path}")
            path.parent.mkdir(parents=True, exist_ok=True)
            layout = layout_dict(_index(module), checkpoint.get("optimizer_states", []), optimizer_classes)
            checkpoint.setdefault("matrix_fsdp_layout", layout)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            _publish(tmp, path, token)

        _agree(_write_file)  # also the barrier: nobody returns before the file is in place
        return
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    import torch.distributed.checkpoint as dcp

    def _mkdir() -> None:
        if rank == 0:
            tmp.mkdir(parents=True)

    _agree(_mkdir)
    converted: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict", {})}
    opt_states = checkpoint.pop("optimizer_states", [])
    for i, s in enumerate(opt_states):
        converted[f"optimizer_{i}"] = s
    dcp.save(converted, storage_writer=FileSystemWriter(str(tmp)),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    index = _index(module)

    def _finish() -> None:
        if rank == 0:
            torch.save(checkpoint, tmp / META_NAME)
            text = json.dumps(layout_dict(index, opt_states, optimizer_classes), indent=1, default=str)
            with open(tmp / SIDECAR_NAME, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())

    _agree(_finish)  # every rank has written its files (dcp.save returned everywhere)
    _agree(lambda: _publish(tmp, path, token) if rank == 0 else None)


def _publish(tmp: Path, path: Path, token: str) -> None:
    """Make ``tmp`` visible as ``path``.  A file replaces a file atomically; otherwise the old
    entry is moved aside first (a crash in between leaves it as ``.mfsdp-old-<token>``)."""
    if tmp.is_file() and (path.is_file() or not path.exists()) and not path.is_symlink():
        os.replace(tmp, path)
    elif path.exists() or path.is_symlink():
        old = path.parent / f"{OLD_PREFIX}{token}"
        os.rename(path, old)
        os.rename(tmp, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        os.rename(tmp, path)
    try:  # persist the rename
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------- load: matching
def _spec(v: Any) -> tuple:
    return ("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("o",)


def _rebase(ck_keys: Sequence[str], module_keys: Iterable[str]) -> dict[str, str]:
    """ck key -> module key.  Identity, unless nothing matches and one prefix (added or stripped)
    maps every checkpoint key onto the module (a plain ``model.state_dict()`` of a submodule)."""
    module_keys = set(module_keys)
    ident = {k: k for k in ck_keys}
    if not ck_keys or any(k in module_keys for k in ck_keys):
        return ident
    prefixes = {k.rsplit(".", i)[0] for k in module_keys for i in range(1, k.count(".") + 1)}
    for p in sorted(prefixes, key=len):
        if all(f"{p}.{k}" in module_keys for k in ck_keys):
            return {k: f"{p}.{k}" for k in ck_keys}
    heads = {k.split(".", 1)[0] for k in ck_keys}
    if len(heads) == 1 and all("." in k for k in ck_keys):
        h = heads.pop()
        if all(k[len(h) + 1:] in module_keys for k in ck_keys):
            return {k: k[len(h) + 1:] for k in ck_keys}
    return ident


@dataclass
class _ModelMatch:
    tensors: list[tuple[str, str]]     # (primary module key, ck key) to load
    objects: list[tuple[str, str]]     # extra state
    to_ck: dict[str, str]              # module key -> ck key, for every matched key
    from_ck: dict[str, str]            # ck key -> module key


def _match_model(index: _Index, specs: Mapping[str, tuple], strict: bool, what: str) -> _ModelMatch:
    """Check keys, shapes and dtypes; raise the documented errors (identically on every rank)."""
    from_ck = _rebase(list(specs), list(index.entries) + list(index.extra))
    to_ck = {m: c for c, m in from_ck.items()}
    known = set(index.entries) | set(index.extra)
    overlap = [k for k in known if k in to_ck]
    if specs and not overlap:
        ex_c, ex_m = sorted(specs)[:3], list(index.entries)[:3]
        raise CheckpointMismatchError(
            f"{what} is a checkpoint of another model: none of its {len(specs)} keys match the module's "
            f"{len(known)} (checkpoint: {ex_c} ..., module: {ex_m} ...)")
    missing, shapes, dtypes, tensors, objects = [], [], [], [], []
    done: set[str] = set()
    for key, e in index.entries.items():
        if e.primary in done:
            continue
        aliases = [k for k, a in index.entries.items() if a.primary == e.primary]
        ck = next((to_ck[a] for a in aliases if a in to_ck), None)
        if ck is None:
            missing.append(e.primary)
            continue
        done.add(e.primary)
        s = specs[ck]
        if s[0] != "t" or tuple(s[1]) != e.shape:
            shapes.append(f"{e.primary}: checkpoint {tuple(s[1]) if s[0] == 't' else 'non-tensor'} vs model {e.shape}")
            continue
        if s[2] != e.dtype:
            dtypes.append(f"{e.primary}: checkpoint {_dtype_name(s[2])} vs model {_dtype_name(e.dtype)}")
        tensors.append((e.primary, ck))
    for key in index.extra:
        if key in to_ck:
            objects.append((key, to_ck[key]))
        else:
            missing.append(key)
    unexpected = sorted(c for c, m in from_ck.items() if m not in known)
    if shapes:
        raise CheckpointMismatchError(f"{what}: shape mismatch for {len(shapes)} tensor(s): " + "; ".join(shapes[:10]))
    if dtypes and strict:
        raise CheckpointMismatchError(
            f"{what}: dtype mismatch for {len(dtypes)} tensor(s): " + "; ".join(dtypes[:10])
            + " (set strict_loading=False to cast to the model's dtypes)")
    if dtypes:
        _warn(f"{what}: casting {len(dtypes)} tensor(s) to the model's dtypes: " + "; ".join(dtypes[:5]))
    if (missing or unexpected) and strict:
        raise CheckpointKeyError(
            f"{what} does not match the module (strict loading): missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. Set the LightningModule's strict_loading=False to "
            "load the matching keys only")
    if missing or unexpected:
        _warn(f"{what}: loading the matching keys only; missing keys {missing[:20]}, "
              f"unexpected keys {unexpected[:20]}")
    return _ModelMatch(tensors, objects, to_ck, from_ck)


def _check_optimizer(i: int, optimizer: torch.optim.Optimizer, current: Sequence[Sequence[str]],
                     saved_groups: Sequence[Mapping[str, Any]], saved_keys: Iterable[str], strict: bool,
                     saved_class: Optional[str], what: str) -> bool:
    """Whether optimizer ``i`` may take this state; raises under strict loading, else warns and skips."""
    problems = []
    if saved_class and saved_class != _class_name(optimizer):
        problems.append(f"it was saved from {saved_class}, the run uses {_class_name(optimizer)}")
    if len(saved_groups) != len(current):
        problems.append(f"it has {len(saved_groups)} param group(s), the current optimizer {len(current)}")
    else:
        for j, (sg, g) in enumerate(zip(saved_groups, optimizer.param_groups)):
            a = {k for k in sg if k not in _IGNORED_GROUP_KEYS}
            b = {k for k in g if k not in _IGNORED_GROUP_KEYS}
            if a != b:
                problems.append(f"param group {j} hyper-parameters differ (only in checkpoint: {sorted(a - b)}, "
                                f"only in the run: {sorted(b - a)})")
                break
    if problems:
        msg = f"{what}: optimizer {i} ({type(optimizer).__name__}) cannot take the saved state: " + "; ".join(problems)
        if strict:
            raise CheckpointMismatchError(msg)
        _warn(msg + "; its state is left as it is (strict_loading=False)")
        return False
    key_problems = []
    for j, (sg, cur) in enumerate(zip(saved_groups, current)):
        if set(sg["params"]) != set(cur):
            key_problems.append(f"group {j}: only in checkpoint {sorted(set(sg['params']) - set(cur))[:10]}, "
                                f"only in the run {sorted(set(cur) - set(sg['params']))[:10]}")
    everything = {k for c in current for k in c}
    stray = sorted(k for k in saved_keys if k not in everything)
    if stray:
        key_problems.append(f"state for parameters the optimizer does not hold: {stray[:10]}")
    if key_problems:
        msg = f"{what}: optimizer {i} parameters differ: " + "; ".join(key_problems)
        if strict:
            raise CheckpointKeyError(msg + ". Set strict_loading=False to restore the matching entries")
        _warn(msg + "; restoring the matching entries")
    return True


def _apply_optimizer(index: _Index, optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]],
                     state: Mapping[str, Mapping[str, Any]]) -> None:
    """Give this rank's routed optimizer its parameters' state and the saved hyper-parameters."""
    native_state: dict[int, Any] = {}
    groups = []
    i = 0
    for g, sg in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in g["params"]:
            key = index.key(p)
            if key in state:
                native_state[i] = dict(state[key])
            ids.append(i)
            i += 1
        hp = {k: v for k, v in g.items() if k != "params"}
        hp.update({k: v for k, v in sg.items() if k not in ("params", "param_names")})
        groups.append({**hp, "params": ids})
    optimizer.load_state_dict({"state": native_state, "param_groups": groups})


# ---------------------------------------------------------------------- load: entry points
def load_weights(module: nn.Module, path: PathLike, strict: bool = True) -> None:
    """Load model weights only (any supported format) into an owner-sharded module; e.g. to
    fine-tune from an ordinary checkpoint in ``on_fit_start``.  Collective."""
    load_sharded(module, path, (), strict=strict)


def load_sharded(module: nn.Module, path: PathLike, optimizers: Iterable[torch.optim.Optimizer] = (),
                 strict: bool = True, weights_only: Optional[bool] = None) -> Optional[dict[str, Any]]:
    """Restore the module and the optimizers in place from any supported checkpoint.  Collective.

    Returns the rest of a Lightning checkpoint (``meta.pt`` of a directory, or the file
    without ``state_dict``), or ``None`` for a weights-only source (a plain ``state_dict``
    file, a DCP directory without ``meta.pt``)."""
    optimizers = [_unwrap(o) for o in optimizers]
    path = Path(_broadcast_object(str(path)))
    kind = _agree(_detect, path)
    index = _index(module)
    if kind == "dir":
        return _load_dir(module, index, path, optimizers, strict, weights_only)
    return _load_file(module, index, path, optimizers, strict, weights_only)


def _detect(path: Path) -> str:
    if path.name.startswith(PARTIAL_PREFIX):
        raise CheckpointCorruptError(f"{path} is an incomplete save (a crash or failure interrupted it); "
                                     "load the previous checkpoint instead")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise CheckpointCorruptError(f"{path} is a directory without DCP '.metadata': not a distributed "
                                         "checkpoint, or its save did not finish")
        return "dir"
    return "file"


@dataclass
class _Dcp:
    model: dict[str, tuple[str, Any]] = field(default_factory=dict)               # key -> (flat key, metadata)
    # optimizer i -> fqn -> [(state key path, flat key, metadata)]
    state: dict[int, dict[str, list[tuple[tuple, str, Any]]]] = field(default_factory=dict)
    groups: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)   # i -> j -> hparam -> flat
    meta: Mapping[str, Any] = field(default_factory=dict)                        # flat key -> DCP metadata

    def specs(self) -> dict[str, tuple]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {k: (("t", tuple(m.size), m.properties.dtype) if isinstance(m, TensorStorageMetadata) else ("o",))
                for k, (_, m) in self.model.items()}


def _parse_dcp(md: Any, known: Sequence[str]) -> _Dcp:
    """Split DCP metadata into model entries and per-optimizer state / param-group entries."""
    import re

    out = _Dcp(meta=md.state_dict_metadata)
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


def _placeholder(m: Any) -> Optional[torch.Tensor]:
    """What DCP loads an entry into: a CPU tensor of the saved size and dtype, or ``None`` for objects."""
    size = getattr(m, "size", None)
    return torch.empty(tuple(size), dtype=m.properties.dtype) if size is not None else None


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


def _nest(pairs: Iterable[tuple[tuple, Any]]) -> dict[str, Any]:
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


def _load_dir(module: nn.Module, index: _Index, path: Path, optimizers: Sequence[torch.optim.Optimizer],
              strict: bool, weights_only: Optional[bool]) -> Optional[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    what = f"checkpoint {path}"

    def prepare() -> tuple[_Dcp, Optional[dict[str, Any]]]:
        try:
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{what}: cannot read the DCP metadata: {e}") from None
        side = read_sidecar(path) if (path / SIDECAR_NAME).exists() else None
        ck = _parse_dcp(md, list(index.entries))
        if side is not None:
            _check_sidecar(side, ck, what)
        return ck, side

    ck, side = _agree(prepare)
    match = _agree(_match_model, index, ck.specs(), strict, what)
    if side is not None:
        _log_layout(side, index)
    n_saved = 1 + max(ck.groups.keys() | ck.state.keys(), default=-1)
    if optimizers and n_saved and n_saved != len(optimizers):
        msg = f"{what} holds {n_saved} optimizer state(s), the run has {len(optimizers)}"
        if strict:
            raise CheckpointMismatchError(msg)  # same verdict on every rank
        _warn(msg + "; restoring the first ones")
    use = [i for i in range(len(optimizers)) if i in ck.groups]
    current = [_full_groups(index, o) for o in optimizers]

    # phase 1: param-group hyper-parameters (small objects), so everything is validated before any data moves
    req1: dict[str, Any] = {flat: _placeholder(ck.meta[flat]) for i in use for g in ck.groups[i].values()
                            for flat in g.values()}
    if req1:
        dcp.load(req1, storage_reader=FileSystemReader(str(path)))
    saved_groups: dict[int, list[dict[str, Any]]] = {}
    for i in use:
        gs = ck.groups[i]
        saved_groups[i] = [{h: req1[f] for h, f in gs[j].items()} for j in sorted(gs)]
        for g in saved_groups[i]:
            g["params"] = [match.from_ck.get(k, k) for k in (g.get("params") or [])]
    sclasses = [o.get("class") for o in side.get("optimizers", [])] if side else []

    def check() -> list[int]:
        ok = []
        for i in use:
            keys = [match.from_ck.get(k, k) for k in ck.state.get(i, {})]
            if _check_optimizer(i, optimizers[i], current[i], saved_groups[i], keys, strict,
                                sclasses[i] if i < len(sclasses) else None, what):
                ok.append(i)
        return ok

    apply = _agree(check)

    # phase 2: tensors, straight into the resident parameters; optimizer state into fresh CPU tensors
    req2: dict[str, Any] = {}
    for key, c in match.tensors:
        e = index.entries[key]
        if e.local is not None:
            req2[ck.model[c][0]] = e.local
    for key, c in match.objects:
        req2[ck.model[c][0]] = None
    wanted: dict[int, dict[str, list[tuple[tuple, str]]]] = {}
    for i in apply:
        for g in optimizers[i].param_groups:
            for p in g["params"]:
                key = index.key(p)
                items = ck.state.get(i, {}).get(match.to_ck.get(key, key), [])
                for tail, flat, m in items:
                    req2[flat] = _placeholder(m)
                    wanted.setdefault(i, {}).setdefault(key, []).append((tail, flat))
    dcp.load(req2, storage_reader=FileSystemReader(str(path)))
    if match.objects:
        module.load_state_dict({k: req2[ck.model[c][0]] for k, c in match.objects}, strict=False)
    for i in apply:
        state = {key: _nest((tail, req2[flat]) for tail, flat in items) for key, items in wanted.get(i, {}).items()}
        _apply_optimizer(index, optimizers[i], saved_groups[i], state)
    if not (path / META_NAME).is_file():
        return None
    return _agree(torch.load, path / META_NAME, map_location="cpu", weights_only=weights_only)


def _check_sidecar(side: Mapping[str, Any], ck: _Dcp, what: str) -> None:
    """The sidecar must describe the data next to it."""
    specs = ck.specs()
    for key, p in side["params"].items():
        if "alias_of" in p:
            continue
        s = specs.get(key)
        if s is None or s[0] != "t" or list(s[1]) != list(p["shape"]) or _dtype_name(s[2]) != p["dtype"]:
            raise CheckpointCorruptError(
                f"{what}: the layout sidecar does not match the saved data at {key!r} (sidecar "
                f"{p.get('shape')}/{p.get('dtype')}, data {s[1:] if s else 'absent'}); the directory was modified "
                "or mixed with another save")


def _log_layout(side: Mapping[str, Any], index: _Index) -> None:
    if _world()[0] != 0:
        return
    import logging

    digests = [p.get("digest") for p in side.get("plans", [])]
    now = [st.plan.digest() for _, st in index.roots]
    first = index.roots[0][1] if index.roots else None
    if digests == now:
        logging.getLogger(__name__).info("matrix_fsdp checkpoint: same layout, loading owned tensors")
    else:
        logging.getLogger(__name__).info(
            "matrix_fsdp checkpoint: resharding from world %s span %s (%s) to world %s span %s (%s)",
            side.get("world_size"), side.get("shard_span"), side.get("planner"), _world()[1],
            first.sg.size if first else 1, first.plan.planner if first else None)


def _torch_load(path: Path, weights_only: Optional[bool]) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as e:
        if "mmap" not in str(e) and "zip" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # legacy (non-zip) files


def _load_file(module: nn.Module, index: _Index, path: Path, optimizers: Sequence[torch.optim.Optimizer],
               strict: bool, weights_only: Optional[bool]) -> Optional[dict[str, Any]]:
    what = f"checkpoint {path}"

    def read() -> tuple[Any, bool]:
        try:
            ckpt = _torch_load(path, weights_only)
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{what}: cannot be read by torch.load: {e}") from None
        if isinstance(ckpt, Mapping) and isinstance(ckpt.get("state_dict"), Mapping):
            return ckpt, True
        if isinstance(ckpt, Mapping) and ckpt and all(isinstance(k, str) for k in ckpt):
            return ckpt, False
        raise CheckpointCorruptError(f"{what} holds neither a Lightning checkpoint nor a state_dict")

    ckpt, lightning = _agree(read)
    sd = ckpt["state_dict"] if lightning else ckpt
    match = _agree(_match_model, index, {k: _spec(v) for k, v in sd.items()}, strict, what)
    saved = list(ckpt.get("optimizer_states") or []) if lightning else []
    restore: list[tuple[torch.optim.Optimizer, list[dict[str, Any]], dict[str, Any]]] = []
    if optimizers and saved:  # validate every optimizer before anything is written
        if len(saved) != len(optimizers):
            msg = f"{what} holds {len(saved)} optimizer state(s), the run has {len(optimizers)}"
            if strict:
                raise CheckpointMismatchError(msg)  # same verdict on every rank
            _warn(msg + "; restoring the first ones")
        layout = ckpt.get("matrix_fsdp_layout") if isinstance(ckpt.get("matrix_fsdp_layout"), Mapping) else {}
        sclasses = [o.get("class") for o in layout.get("optimizers", [])]
        for i, o in enumerate(optimizers[: len(saved)]):
            current = _full_groups(index, o)

            def prep(i: int = i, o: Any = o, current: Any = current) -> Optional[tuple]:
                groups, state = from_native(saved[i], current)
                for g in groups:
                    g["params"] = [match.from_ck.get(k, k) for k in g["params"]]
                state = {match.from_ck.get(k, k): v for k, v in state.items()}
                ok = _check_optimizer(i, o, current, groups, state, strict,
                                      sclasses[i] if i < len(sclasses) else None, what)
                return (groups, state) if ok else None

            got = _agree(prep)
            if got is not None:
                restore.append((o, *got))
    with torch.no_grad():
        for key, c in match.tensors:
            e = index.entries[key]
            if e.local is not None:
                e.local.copy_(sd[c])
    if match.objects:
        module.load_state_dict({k: sd[c] for k, c in match.objects}, strict=False)
    for o, groups, state in restore:
        held = {index.key(p) for g in o.param_groups for p in g["params"]}
        mine = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
                for k, s in state.items() if k in held}
        _apply_optimizer(index, o, groups, mine)
    if not lightning:
        return None
    rest = dict(ckpt)
    rest.pop("state_dict", None)
    return rest


# ---------------------------------------------------------------------- Lightning strategy adapters
def _module(strategy: Any) -> nn.Module:
    module = strategy.lightning_module
    if module is None:
        raise CheckpointError("the strategy has no LightningModule attached")
    return module


def module_state_dict(strategy: Any, full: bool) -> dict:
    """``MatrixFSDPStrategy.lightning_module_state_dict``."""
    return sharded_model_state_dict(_module(strategy), full)


def optimizer_state_dict(strategy: Any, optimizer: Any, full: bool) -> dict:
    """``MatrixFSDPStrategy.optimizer_state``."""
    return sharded_optimizer_state_dict(_module(strategy), optimizer, full)


def save(strategy: Any, checkpoint: dict, filepath: Any) -> None:
    """``MatrixFSDPStrategy.save_checkpoint``: a DCP directory, or one consolidated file."""
    write_checkpoint(_module(strategy), checkpoint, filepath, full=not strategy._save_distributed_checkpoint,
                     optimizer_classes=[_class_name(o) for o in strategy.optimizers])


def load(strategy: Any, path: Any, weights_only: Optional[bool] = None) -> dict:
    """``MatrixFSDPStrategy.load_checkpoint``: restore model and optimizers in place and return
    the rest (loops, schedulers, callbacks) as ``ModelParallelStrategy.load_checkpoint`` does.
    A weights-only source (plain ``state_dict`` file) restarts everything else fresh."""
    module = _module(strategy)
    rest = load_sharded(module, path, strategy.optimizers, strict=bool(getattr(module, "strict_loading", True)),
                        weights_only=weights_only)
    if rest is None:
        import lightning.pytorch as pl

        rest = {"pytorch-lightning_version": pl.__version__, "lr_schedulers": []}
    return rest
