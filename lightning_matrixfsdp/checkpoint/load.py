"""Loading any supported checkpoint into an owner-sharded module and its optimizers.

Every step is agreed across ranks before the next, and nothing is written into the
module or the optimizers before everything has been validated *and read*: the files'
sizes and checksums, the keys, shapes and dtypes, the optimizers, the parameters'
roles, ``meta.pt``, and finally every tensor this rank will hold (into fresh CPU
buffers). A load that fails at any point leaves the model and the optimizers as they
were. Each rank reads only the tensors it owns under the *current* plan, so any world
size, shard span or planner can resume.
"""
from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException

import lightning_matrixfsdp.checkpoint.pending as pending_saves
from lightning_matrixfsdp.checkpoint.agree import (
    agree,
    agreed_path,
    describe_failure,
    single_process_quiet,
    warn,
    world,
)
from lightning_matrixfsdp.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from lightning_matrixfsdp.checkpoint.formats import (
    DcpEntries,
    from_native,
    nest,
    parse_dcp,
    placeholder,
    spec,
    unwrap_optimizer,
)
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.integrity import verify_files, verify_zip
from lightning_matrixfsdp.checkpoint.save import PARTIAL_PREFIX, PathLike
from lightning_matrixfsdp.checkpoint.optimizer_state import StateRule, apply_optimizer, saved_splits
from lightning_matrixfsdp.checkpoint.sidecar import META_NAME, SIDECAR_NAME, check_sidecar, layout_change, read_sidecar
from lightning_matrixfsdp.checkpoint.sidecar import roles_of
from lightning_matrixfsdp.checkpoint.state_dict import full_groups
from lightning_matrixfsdp.checkpoint.validate import changed_roles, check_optimizer, check_resumable, match_model
from lightning_matrixfsdp.checkpoint.views import localize_views, read_refs, state_view
from lightning_matrixfsdp.runtime.views.checkpoint import note_loaded

__all__ = ["check_resumable", "load_sharded", "load_weights", "meta_required", "read_dcp", "read_file", "read_meta"]

log = logging.getLogger(__name__)


def load_weights(module: nn.Module, path: PathLike, strict: bool = True, *, verify: bool = True) -> None:
    """Load model weights only (any supported format) into an owner-sharded module; e.g. to
    fine-tune from an ordinary checkpoint in ``on_fit_start``.  Collective."""
    load_sharded(module, path, (), strict=strict, verify=verify)


def load_sharded(module: nn.Module, path: PathLike, optimizers: Iterable[torch.optim.Optimizer] = (),
                 strict: bool = True, weights_only: Optional[bool] = None, *, verify: bool = True,
                 reset_changed_roles: bool = False, resume: bool = False,
                 before_optimizers: Optional[Callable[[Mapping[str, Any]], None]] = None,
                 with_state_dict: bool = False) -> Optional[dict[str, Any]]:
    """Restore the module and the optimizers in place from any supported checkpoint.  Collective.

    Returns the rest of a Lightning checkpoint (``meta.pt`` of a directory, or the file
    without ``state_dict``), or ``None`` for a weights-only source (a plain ``state_dict``
    file, a DCP directory of weights without ``meta.pt``).

    ``verify``: check the checksums the save recorded (sizes are always checked).
    ``reset_changed_roles``: parameters whose optimizer role changed since the save (a
    changed ``matrix_filter``) restart their optimizer state instead of raising.
    ``resume``: the load resumes training (``fit(ckpt_path=...)``); a source without the training
    state (weights only) raises :class:`CheckpointNotResumableError` before anything is written.
    ``before_optimizers(rest)``: runs on every rank once the rest of a Lightning checkpoint is
    read and before the optimizers are looked at (the Trainer puts back param groups that a
    fine-tuning callback added, as DDP's restore order does).

    ``with_state_dict``: the returned rest also holds the loaded ``state_dict`` as this rank's
    view (``checkpoint/views.py``), as Lightning's hooks expect. Views elsewhere in the rest
    (a weight-averaging callback's averaged model) always come back as this rank's views."""
    optimizers = [unwrap_optimizer(o) for o in optimizers]
    path = agreed_path(path, optimizers=len(optimizers), strict=bool(strict), weights_only=weights_only,
                       verify=bool(verify), reset_changed_roles=bool(reset_changed_roles), resume=bool(resume))
    agree(pending_saves.wait_for, path)  # a save of it in the background (async_save) completes first
    kind = agree(_detect, path)
    index = build_index(module)
    load = _load_dir if kind == "dir" else _load_file
    return load(module, index, path, optimizers, strict, weights_only, verify, reset_changed_roles, resume,
                before_optimizers, with_state_dict)


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
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is neither a file nor a directory")
    return "file"


def open_dcp(src: Path, verify: bool = True) -> tuple[Any, Optional[dict[str, Any]]]:
    """A DCP directory's metadata and layout sidecar (None if it has none), after checking
    its files against the sidecar's sizes (and checksums with ``verify``) in this process."""
    from torch.distributed.checkpoint import FileSystemReader

    pending_saves.wait_for(src)  # a save of it in the background (async_save) completes first
    if not (src / ".metadata").is_file():
        raise CheckpointCorruptError(f"{src} has no DCP '.metadata': not a distributed checkpoint, or incomplete")
    side = read_sidecar(src) if (src / SIDECAR_NAME).is_file() else None
    if side is not None and isinstance(side.get("files"), Mapping):
        verify_files(src, side["files"], checksums=verify, collective=False)
    return FileSystemReader(str(src)).read_metadata(), side


def read_dcp(entries: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` of ``entries`` from directory ``path``; a failure (torch's ``CheckpointException``,
    a ``BaseException``) becomes a :class:`CheckpointCorruptError` that names the data files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with single_process_quiet():
            dcp.load(entries, storage_reader=FileSystemReader(str(path)), no_dist=no_dist)
    except CheckpointException as e:
        data = sorted(path.glob("*.distcp"))
        empty = [p.name for p in data if p.stat().st_size == 0]
        files = (f"empty data file(s) {', '.join(empty)}" if empty else
                 "data files " + ", ".join(f"{p.name} ({p.stat().st_size} bytes)" for p in data[:16]))
        raise CheckpointCorruptError(f"checkpoint {path}: reading the data failed ({describe_failure(e)}); "
                                     f"{files}: one is truncated or damaged; load an intact copy or an earlier "
                                     "checkpoint") from None


def read_file(src: Path, verify: bool = True,
              safe: bool = True) -> tuple[dict[str, Any], bool, Optional[Mapping]]:
    """A consolidated file in one process: (the whole object as a dict, whether it is a
    Lightning checkpoint rather than a plain ``state_dict``, its layout record or None).
    Verified against the zip CRC-32s unless ``verify=False``; a file that is neither a
    Lightning checkpoint nor a plain ``state_dict`` raises :class:`CheckpointCorruptError`."""
    pending_saves.wait_for(src)
    if verify:
        verify_zip(src, collective=False)
    try:
        ck = torch.load(src, map_location="cpu", mmap=True, weights_only=safe)
    except Exception as e:  # noqa: BLE001 - any failure is a damaged or foreign file
        raise CheckpointCorruptError(f"{src} cannot be read by torch.load: {e}") from None
    lightning = isinstance(ck, Mapping) and isinstance(ck.get("state_dict"), Mapping)
    if not lightning and not (isinstance(ck, Mapping) and all(isinstance(k, str) for k in ck)):
        raise CheckpointCorruptError(f"{src} holds neither a Lightning checkpoint nor a state_dict")
    layout = ck.get("matrix_fsdp_layout") if lightning else None
    return dict(ck), lightning, layout if isinstance(layout, Mapping) else None


def read_meta(path: Path, weights_only: Optional[bool]) -> Any:
    """``meta.pt`` of directory ``path``; a failure names the file, and says when it is only
    ``weights_only=True`` refusing objects (not damage)."""
    try:
        return torch.load(path / META_NAME, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e):
            raise CheckpointError(f"checkpoint {path}: {META_NAME} holds objects torch.load(weights_only=True) "
                                  f"refuses; if you trust the file, load with weights_only=False: {e}") from None
        raise CheckpointCorruptError(f"checkpoint {path}: {META_NAME} cannot be read: {e}") from None
    except Exception as e:  # noqa: BLE001 - any other failure is a damaged or foreign file
        raise CheckpointCorruptError(f"checkpoint {path}: {META_NAME} cannot be read: {e}") from None


def meta_required(side: Optional[Mapping[str, Any]], ck: DcpEntries) -> bool:
    """Whether a directory must hold ``meta.pt``: the save listed it among its files, or (older
    sidecars, foreign directories) it holds optimizer state or was written by a training run."""
    files = side.get("files") if side else None
    if isinstance(files, Mapping):
        return META_NAME in files
    return ck.n_optimizers() > 0 or (side is not None and side.get("converted_from") != "file")


def _load_dir(module: nn.Module, index: KeyIndex, path: Path, optimizers: Sequence[torch.optim.Optimizer],
              strict: bool, weights_only: Optional[bool], verify: bool, reset: bool, resume: bool,
              before_optimizers: Optional[Callable[[Mapping[str, Any]], None]] = None,
              with_state_dict: bool = False) -> Optional[dict[str, Any]]:
    """A checkpoint directory, stage by stage (:class:`_DirectoryLoad`); every stage agreed across ranks."""
    load = _DirectoryLoad(module, index, path, optimizers, strict)
    load.open(weights_only, verify)
    if resume:
        agree(check_resumable, load.what, load.ck.n_optimizers() > 0, load.meta)
    if before_optimizers is not None and optimizers and isinstance(load.meta, Mapping):
        agree(before_optimizers, load.meta)
    load.match_model()
    load.check_optimizers(reset)
    load.read()
    load.write()
    return load.rest(with_state_dict)


class _DirectoryLoad:
    """One load of a checkpoint directory, its stages in order: ``open``, ``match_model``,
    ``check_optimizers`` (before any data moves), ``read`` (into fresh buffers), ``write``, ``rest``."""

    def __init__(self, module: nn.Module, index: KeyIndex, path: Path,
                 optimizers: Sequence[torch.optim.Optimizer], strict: bool) -> None:
        self.module, self.index, self.path, self.optimizers, self.strict = module, index, path, optimizers, strict
        self.what = f"checkpoint {path}"

    def _prepare(self) -> tuple[DcpEntries, Optional[dict[str, Any]]]:
        from torch.distributed.checkpoint import FileSystemReader

        path, what = self.path, self.what
        try:  # metadata, sidecar, the presence of meta.pt: the same verdict on every rank
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{what}: cannot read the DCP metadata: {e}") from None
        side = read_sidecar(path) if (path / SIDECAR_NAME).exists() else None
        ck = parse_dcp(md, list(self.index.entries) + list(self.index.remote))
        if side is not None:
            check_sidecar(side, ck, what)
        if not (path / META_NAME).is_file() and meta_required(side, ck):
            raise CheckpointCorruptError(
                f"{what}: {path / META_NAME} is missing; it holds the epoch, global step, loops, LR schedulers "
                "and callbacks, so resuming without it would silently restart at step 0. Restore the file or "
                "load an intact copy")
        return ck, side

    def open(self, weights_only: Optional[bool], verify: bool) -> None:
        """The entries (``ck``), the sidecar (``side``) and ``meta.pt`` (``meta``, None without one)."""
        self.ck, self.side = agree(self._prepare)
        if self.side is not None and isinstance(self.side.get("files"), Mapping):
            verify_files(self.path, self.side["files"], checksums=verify)
        self.meta = agree(read_meta, self.path, weights_only) if (self.path / META_NAME).is_file() else None

    def match_model(self) -> None:
        """The saved keys against the model's (``match``), and the view requests of ``meta.pt``."""
        self.match = agree(match_model, self.index, self.ck.specs(), self.strict, self.what)
        self.view_req = {} if self.meta is None else agree(read_refs, self.meta, self.ck.meta, self.index, self.what)
        if self.side is not None and world()[0] == 0:
            log.info("matrix_fsdp checkpoint: %s", layout_change(self.side, self.index))

    def check_optimizers(self, reset: bool) -> None:
        """Phase 1: the saved param groups (small objects) read and every optimizer checked against them:
        ``apply`` (the optimizers restored), ``dropped`` (keys whose role changed, restarted with ``reset``)."""
        ck, side, match, optimizers, what = self.ck, self.side, self.match, self.optimizers, self.what
        n_saved = ck.n_optimizers()
        if optimizers and n_saved and n_saved != len(optimizers):
            msg = f"{what} holds {n_saved} optimizer state(s), the run has {len(optimizers)}"
            if self.strict:
                raise CheckpointMismatchError(msg)  # same verdict on every rank
            warn(msg + "; restoring the first ones")
        self.use = [i for i in range(len(optimizers)) if i in ck.groups]
        self.current = [full_groups(self.index, o) for o in optimizers]
        req1: dict[str, Any] = {flat: placeholder(ck.meta[flat]) for i in self.use for g in ck.groups[i].values()
                                for flat in g.values()}
        if req1:
            agree(read_dcp, req1, self.path)
        self.saved_groups: dict[int, list[dict[str, Any]]] = {}
        for i in self.use:
            gs = ck.groups[i]
            self.saved_groups[i] = [{h: req1[f] for h, f in gs[j].items()} for j in sorted(gs)]
            for g in self.saved_groups[i]:
                g["params"] = [match.from_ck.get(k, k) for k in (g.get("params") or [])]
        self.sclasses = [o.get("class") for o in side.get("optimizers", [])] if side else []
        self.saved_roles = {match.from_ck.get(k, k): r for k, r in roles_of(side).items()}
        self.apply, self.dropped = agree(self._check, reset)

    def _check(self, reset: bool) -> tuple[list[int], set[str]]:
        ck, match, sclasses = self.ck, self.match, self.sclasses
        ok = []
        for i in self.use:
            keys = [match.from_ck.get(k, k) for k in ck.state.get(i, {})]
            if check_optimizer(i, self.optimizers[i], self.current[i], self.saved_groups[i], keys, self.strict,
                               sclasses[i] if i < len(sclasses) else None, self.what):
                ok.append(i)
        with_state = {match.from_ck.get(k, k) for i in ok for k in ck.state.get(i, {})}
        return ok, changed_roles(self.index, self.saved_roles, with_state, reset, self.what)

    def read(self) -> None:
        """Phase 2: everything this rank will hold, read into fresh ``buffers``; nothing is written yet. A TP-split
        tensor is the global tensor on disk (any saving mesh): a TP rank asks for its fragment."""
        ck, match, index = self.ck, self.match, self.index
        req2: dict[str, Any] = {}
        self.targets: list[tuple[torch.Tensor, str]] = []
        for key, c in match.tensors:
            e = index.entries[key]
            if e.local is not None:
                flat = ck.model[c][0]
                m = ck.meta[flat]
                req2[flat] = index.fragment_request(key, m.properties.dtype) if e.chunk is not None else placeholder(m)
                self.targets.append((e.local, flat))
        for key, c in match.objects:
            req2[ck.model[c][0]] = None
        req2.update(self.view_req)
        self.splits = saved_splits(self.side, match.from_ck)
        self.wanted = agree(self._state_requests)
        req2.update({flat: buf for per in self.wanted.values() for items in per.values() for _, flat, buf in items})
        agree(read_dcp, req2, self.path)
        self.buffers = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in req2.items()}  # TP: plain

    def _state_requests(self) -> dict[int, dict[str, list[tuple[tuple, str, Any]]]]:
        index, match = self.index, self.match
        wanted: dict[int, dict[str, list[tuple[tuple, str, Any]]]] = {}
        for i in self.apply:
            rule = StateRule(index, self.optimizers[i], self.splits, self.what)  # the target says whole or fragment
            for g in self.optimizers[i].param_groups:
                for p in g["params"]:
                    key = index.key(p)
                    if key in self.dropped or not index.steps(key) or not rule.reads(key):  # replica_split, whole
                        continue
                    for tail, flat, m in self.ck.state.get(i, {}).get(match.to_ck.get(key, key), []):
                        buf = rule.dcp_buffer(key, ".".join(map(str, tail)), m)
                        wanted.setdefault(i, {}).setdefault(key, []).append((tail, flat, buf))
        return wanted

    def write(self) -> None:
        """Phase 3: in place (extra state first: user code that may still raise)."""
        ck, match, buffers = self.ck, self.match, self.buffers
        if match.objects:
            agree(self.module.load_state_dict, {k: buffers[ck.model[c][0]] for k, c in match.objects}, strict=False)
        with torch.no_grad():
            for local, flat in self.targets:
                local.copy_(buffers[flat])
        _note_loaded(self.module, match)
        for i in self.apply:
            state = {key: nest((tail, buffers[flat]) for tail, flat, _ in items)
                     for key, items in self.wanted.get(i, {}).items()}
            agree(apply_optimizer, self.index, self.optimizers[i], self.saved_groups[i], state)

    def rest(self, with_state_dict: bool) -> Optional[dict[str, Any]]:
        """``meta.pt`` with this rank's views (+ the ``state_dict`` as one), or None without ``meta.pt``."""
        if self.meta is None:
            return None
        meta = localize_views(self.meta, self.index, self.what, read=self.buffers)
        if with_state_dict:
            read = {c: self.buffers.get(f) for c, (f, _) in self.ck.model.items()}
            meta = {**meta, "state_dict": state_view(read, self.match.from_ck, self.index)}
        return meta


def _note_loaded(module: nn.Module, match: Any) -> None:
    """The parameters this load wrote hold values now (``load_pretrained`` may leave them out later)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    note_loaded(module, [id(params[k]) for k in match.to_ck if k in params])


def _torch_load(path: Path, weights_only: Optional[bool]) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as e:
        if "mmap" not in str(e) and "zip" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # legacy (non-zip) files


def _load_file(module: nn.Module, index: KeyIndex, path: Path, optimizers: Sequence[torch.optim.Optimizer],
               strict: bool, weights_only: Optional[bool], verify: bool, reset: bool,
               resume: bool,
               before_optimizers: Optional[Callable[[Mapping[str, Any]], None]] = None,
               with_state_dict: bool = False) -> Optional[dict[str, Any]]:
    what = f"checkpoint {path}"
    if verify:
        verify_zip(path)

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

    ckpt, lightning = agree(read)
    if resume:
        agree(check_resumable, what, lightning and "optimizer_states" in ckpt, ckpt if lightning else None)
    if before_optimizers is not None and optimizers and lightning:
        agree(before_optimizers, ckpt)
    sd = ckpt["state_dict"] if lightning else ckpt
    match = agree(match_model, index, {k: spec(v) for k, v in sd.items()}, strict, what)
    saved = list(ckpt.get("optimizer_states") or []) if lightning else []
    restore: list[tuple[torch.optim.Optimizer, list[dict[str, Any]], dict[str, Any]]] = []
    if optimizers and saved:  # validate every optimizer before anything is written
        if len(saved) != len(optimizers):
            msg = f"{what} holds {len(saved)} optimizer state(s), the run has {len(optimizers)}"
            if strict:
                raise CheckpointMismatchError(msg)  # same verdict on every rank
            warn(msg + "; restoring the first ones")
        layout = ckpt.get("matrix_fsdp_layout") if isinstance(ckpt.get("matrix_fsdp_layout"), Mapping) else {}
        sclasses = [o.get("class") for o in layout.get("optimizers", [])]
        saved_roles = {match.from_ck.get(k, k): r for k, r in roles_of(layout).items()}
        splits = saved_splits(layout, match.from_ck)
        for i, o in enumerate(optimizers[: len(saved)]):
            current = full_groups(index, o)

            def prep(i: int = i, o: Any = o, current: Any = current) -> Optional[tuple]:
                groups, state = from_native(saved[i], current)
                for g in groups:
                    g["params"] = [match.from_ck.get(k, k) for k in g["params"]]
                state = {match.from_ck.get(k, k): v for k, v in state.items()}
                ok = check_optimizer(i, o, current, groups, state, strict,
                                     sclasses[i] if i < len(sclasses) else None, what)
                if not ok:
                    return None
                dropped = changed_roles(index, saved_roles, state, reset, what)
                # this rank's part, checked before anything is written (TP: fragments, or whole state on the stepper)
                rule = StateRule(index, o, splits, what)
                held = {k for g in o.param_groups for p in g["params"] if index.steps(k := index.key(p))}
                return groups, {k: rule.from_file(k, v) for k, v in state.items()
                                if k in held and k not in dropped and rule.reads(k)}

            got = agree(prep)
            if got is not None:
                restore.append((o, *got))
    rest: Optional[dict[str, Any]] = None
    if lightning:  # this rank's views of the sharded tensors the rest holds (checked before anything is written)
        layout = ckpt.get("matrix_fsdp_layout")
        records = layout.get("views") if isinstance(layout, Mapping) else None
        rest = {k: v for k, v in ckpt.items() if k != "state_dict"}
        rest = agree(localize_views, rest, index, what, records=records or ())
        if with_state_dict:
            rest["state_dict"] = state_view(sd, match.from_ck, index)
    # in place (extra state first: user code that may still raise)
    if match.objects:
        agree(module.load_state_dict, {k: sd[c] for k, c in match.objects}, strict=False)
    with torch.no_grad():
        for key, c in match.tensors:
            e = index.entries[key]
            if e.local is not None:
                e.local.copy_(index.narrow(key, sd[c]))  # a TP rank: its fragment of the whole tensor
    _note_loaded(module, match)
    for o, groups, state in restore:
        agree(apply_optimizer, index, o, groups, state)
    return rest
