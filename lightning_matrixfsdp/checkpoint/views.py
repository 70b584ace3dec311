"""Sharded tensors anywhere in a checkpoint: this rank's *views* of the model, written by their owners.

A view of a model tensor is what this rank holds of it: the whole tensor where it owns
it, an empty placeholder ``(0, *shape[1:])`` where another rank does, marked with the
model key (``runtime.checkpoint_view.tag_view``). Lightning's checkpoint dict holds views in more
places than ``state_dict``: the strategy's ``lightning_module_state_dict`` is a view of
the model (every key on every rank), and weight-averaging callbacks add the view of
their averaged copy (``runtime/views/copies.py``): ``WeightAveraging`` moves the model's to
``current_model_state`` and puts the averaged one under ``state_dict``;
``StochasticWeightAveraging`` keeps its averaged one in its own callback state.

With tensor parallelism the owner's view of a TP-split key is this TP rank's fragment (and a
placeholder has the fragment's trailing shape, as a sharded copy's has); each is written
through ``KeyIndex.as_saved``, so DCP records the global tensor with one chunk per TP rank, and
a load gives every TP rank its fragment back.

Saving, no placeholder is ever written as a weight:

* directory: views under the top-level ``state_dict`` are the model entries DCP writes,
  each from its owner (placeholders dropped); every other view goes to DCP under
  ``matrix_fsdp_views.<digest of its path>``, from its owner, and ``meta.pt`` holds a
  small reference in its place (``{"matrix_fsdp_view": digest, "key": ..., ...}``).
* file: every view is gathered to rank 0 (one tensor at a time, as the model's own
  state) and written whole; the layout record lists their paths (``views``). Not with
  tensor parallelism yet (refused).

Loading gives every rank its views back: references and recorded paths become the whole
tensor where this rank owns the key *now* (any world size or plan) and a placeholder
elsewhere, so ``load_state_dict`` of the model or of a sharded copy takes them as they are.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.agree import all_gather_object, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from lightning_matrixfsdp.checkpoint.formats import placeholder
from lightning_matrixfsdp.checkpoint.index import KeyIndex
from lightning_matrixfsdp.checkpoint.state_dict import fragments_to_rank0, stages_to_rank0, to_rank0, tp_sources
from lightning_matrixfsdp.runtime.views.checkpoint import Chunked, Owned, tag_view, view_key
from lightning_matrixfsdp.runtime.comm.core import comm_device

__all__ = ["REF", "VIEWS", "find_refs", "gather_views", "localize_views", "model_view", "read_refs", "refs_to_whole",
           "split_views", "state_view", "whole_to_refs"]

VIEWS = "matrix_fsdp_views"  # the DCP entry that holds the views found outside ``state_dict``
REF = "matrix_fsdp_view"     # the key that marks a reference in ``meta.pt``
_DROP = object()


def _placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((0, *tuple(shape)[1:]) if len(shape) else (0,), dtype=dtype)


def _local_shape(index: KeyIndex, key: str) -> tuple[int, ...]:
    """The shape of ``key`` as its owner holds it: this TP rank's fragment of a TP-split key, else whole."""
    shape = index.fragment_shape(key)
    return shape if shape is not None else index.entries[key].shape


def _empty(index: KeyIndex, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The placeholder of ``key`` on a rank that does not own it (the shape a copy's placeholder has)."""
    return _placeholder(_local_shape(index, key), dtype if dtype is not None else index.entries[key].dtype)


def model_view(index: KeyIndex) -> dict[str, Any]:
    """The module's ``state_dict`` as this rank holds it: every key, every tensor a view (with
    tensor parallelism, this TP rank's fragment of a split key where its owner is)."""
    out: dict[str, Any] = {}
    for key in index.order:
        e = index.entries.get(key)
        if e is None:
            out[key] = index.extra[key]
        else:  # replicated tensors too: a file gets them from rank 0, on the CPU
            t = e.local.detach() if e.local is not None else _empty(index, key)
            out[key] = tag_view(t, key)
    return out


# ---------------------------------------------------------------------- walking a checkpoint
def _map(obj: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """``obj`` with ``fn(path, x)`` applied to every view or reference in it; containers on the
    way are copied, everything else is kept as it is (the callers' objects are not mutated)."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj) if view_key(obj) is not None else obj
    if isinstance(obj, Mapping) and REF in obj:
        return fn(path, obj)
    if isinstance(obj, dict) or type(obj) in (list, tuple):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        new = [(k, _map(v, fn, path + (k,))) for k, v in items]
        if all(n is v for (_, n), v in zip(new, (obj.values() if isinstance(obj, dict) else obj))):
            return obj
        if isinstance(obj, dict):
            out = type(obj)() if type(obj) is not dict else {}
            for k, v in new:
                if v is not _DROP:
                    out[k] = v
            return out
        return type(obj)(v for _, v in new if v is not _DROP)
    return obj


def _find(obj: Any) -> list[tuple[tuple, Any]]:
    found: list[tuple[tuple, Any]] = []
    _map(obj, lambda p, x: found.append((p, x)) or x)
    return found


def find_refs(meta: Any) -> list[tuple[tuple, Mapping[str, Any]]]:
    """The references a directory's ``meta.pt`` holds, with their paths."""
    return [(p, x) for p, x in _find(meta) if isinstance(x, Mapping)]


def _digest(path: tuple) -> str:
    return hashlib.sha1(repr(path).encode()).hexdigest()[:20]


def _agreed_views(checkpoint: Mapping[str, Any], index: KeyIndex) -> list[tuple[tuple, torch.Tensor, str]]:
    """Every view of ``checkpoint`` as (path, tensor, key), after checking that every rank holds
    the same ones and that each is the owner's whole tensor or a placeholder. Collective."""
    found = [(p, t, view_key(t)) for p, t in _find(checkpoint) if isinstance(t, torch.Tensor)]
    bad = None
    for p, t, key in found:
        e = index.entries.get(key)
        if e is None:
            bad = f"{p} is marked as a view of {key!r}, which the model does not have"
        elif index.mine(key) and tuple(t.shape) != _local_shape(index, key) or not index.mine(key) and t.numel():
            bad = f"{p}: a view of {key!r} of shape {tuple(t.shape)} (this rank's is {_local_shape(index, key)})"
    everyone = all_gather_object(([(p, k) for p, _, k in found], bad, index.pp_rank))
    pp = index.pp_size > 1
    for r, (paths, b, place) in enumerate(everyone):
        if b is not None:
            raise CheckpointError(f"cannot write the sharded tensors of this checkpoint: {b} (rank {r})")
        # pipeline parallelism: the ranks of one pipeline place hold the same stages, so the same views
        r0 = next(q for q, e in enumerate(everyone) if e[2] == place) if pp else 0
        if paths != everyone[r0][0]:
            raise CheckpointError(f"ranks {r0} and {r} hold different sharded tensors in the checkpoint dict (a hook "
                                  "put a rank-dependent structure in it): every rank must hold the same keys")
        outside = [p for p, _ in paths if not (len(p) == 2 and p[0] == "state_dict")]
        if pp and outside:
            raise CheckpointError(f"under pipeline parallelism a checkpoint holds sharded tensors only in its "
                                  f"state_dict yet; {outside[0]} (rank {r}) is a copy of the model elsewhere (a weight-"
                                  "averaging callback's averaged model): such callbacks train under pipeline "
                                  "parallelism, but their state cannot be saved yet; save the model's weights only "
                                  "(ModelCheckpoint(save_weights_only=True); after fit they are the average), or "
                                  "train without the callback or with pipeline_parallel_size=1")
    return found


def _union(checkpoint: Mapping[str, Any], index: KeyIndex) -> list[tuple[tuple, str]]:
    """Pipeline parallelism: the ``state_dict`` views of every stage (each rank holds its stages'),
    in model order. Collective."""
    seen: dict[tuple, str] = {}
    for paths in all_gather_object([(p, view_key(t)) for p, t in _find(checkpoint) if isinstance(t, torch.Tensor)]):
        for p, k in paths:
            seen.setdefault(tuple(p), str(k))
    return sorted(seen.items(), key=lambda pk: index.position(pk[1]))


# ---------------------------------------------------------------------- saving
def split_views(checkpoint: Mapping[str, Any], index: KeyIndex) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Directory saves: (the checkpoint with every view outside ``state_dict`` replaced by a
    reference and the placeholders of ``state_dict`` dropped, {digest: tensor this rank
    writes}). Collective."""
    found = {p: (t, k) for p, t, k in _agreed_views(checkpoint, index)}
    payload: dict[str, torch.Tensor] = {}

    def fn(path: tuple, t: torch.Tensor) -> Any:
        key = found[path][1]
        mine = index.mine(key)
        if len(path) == 2 and path[0] == "state_dict":  # the model entries DCP writes
            return index.as_saved(key, t) if mine else _DROP  # a TP fragment: its chunk of the global tensor
        digest = _digest(path)
        if mine:
            payload[digest] = index.as_saved(key, t)
        return _ref(digest, key)

    return _map(dict(checkpoint), fn), payload


def _ref(digest: str, key: str) -> dict[str, str]:
    return {REF: digest, "key": key}


def gather_views(checkpoint: Mapping[str, Any], index: KeyIndex) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """File saves: (the checkpoint with every view replaced by the whole tensor on rank 0, the
    records of their paths for the layout). Collective; one tensor at a time (a TP-split one as
    its fragments, concatenated on rank 0)."""
    if index.pp_size > 1:
        return _gather_stages(checkpoint, index)
    rank = world()[0]
    device = comm_device()
    whole: dict[tuple, Optional[torch.Tensor]] = {}
    records = []
    sources = tp_sources(index)  # TP: who sends each fragment (the owners' TP groups)
    for path, t, key in _agreed_views(checkpoint, index):
        e = index.entries[key]
        h = e.holding
        if isinstance(h, Chunked):  # this rank's chunk (a TP fragment where owned, its experts): joined on rank 0
            whole[path] = fragments_to_rank0(index, key, t if index.mine(key) else None, sources.get(key), e.dtype,
                                             device)
        elif isinstance(h, Owned):
            whole[path] = to_rank0(t if index.mine(key) else None, e.shape, e.dtype, h.owner_global,
                                   index.in_group0, device)
        else:  # replicated
            whole[path] = t.cpu() if rank == 0 else None
        if not (len(path) == 2 and path[0] == "state_dict"):  # the model's own entries need no record
            records.append({"path": list(path), "key": key})
    return _map(dict(checkpoint), lambda p, t: whole[p] if rank == 0 else t), records


def _gather_stages(checkpoint: Mapping[str, Any], index: KeyIndex) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``gather_views`` under pipeline parallelism: every stage's ``state_dict`` views, whole on rank 0,
    where its ``state_dict`` (which held its own stage's) now holds every stage's, in model order."""
    _agreed_views(checkpoint, index)
    union = _union(checkpoint, index)
    whole = stages_to_rank0(index, [k for _, k in union])
    if world()[0] != 0:
        return dict(checkpoint), []
    out = dict(checkpoint)
    sd = dict(out.get("state_dict") or {})
    others = {k: v for k, v in sd.items() if not (isinstance(v, torch.Tensor) and view_key(v) is not None)}
    out["state_dict"] = {**{p[1]: whole[k] for p, k in union}, **index.remote_extra, **others}
    return out, []


# ---------------------------------------------------------------------- loading
def _check(key: str, shape: Sequence[int], index: KeyIndex, where: str) -> None:
    e = index.entries.get(key)
    if e is None:
        raise CheckpointMismatchError(f"{where} holds a copy of the model tensor {key!r}, which the model does not "
                                      "have (a checkpoint of another model, or the model changed)")
    if tuple(shape) != e.shape:
        raise CheckpointMismatchError(f"{where}: the copy of {key!r} has shape {tuple(shape)}, the model's is "
                                      f"{e.shape}")


def _local(key: str, value: torch.Tensor, index: KeyIndex, where: str) -> torch.Tensor:
    """``value`` (a whole tensor) as this rank's view of ``key`` (with TP, its fragment)."""
    _check(key, value.shape, index, where)
    return index.narrow(key, value).contiguous() if index.mine(key) else _empty(index, key, value.dtype)


def read_refs(meta: Any, dcp_meta: Mapping[str, Any], index: KeyIndex, what: str) -> dict[str, Any]:
    """Directory loads: the DCP requests (flat key -> buffer) for the references in ``meta``
    whose key this rank owns; every reference is checked against the DCP data and the model."""
    req: dict[str, Any] = {}
    for path, ref in find_refs(meta):
        flat = f"{VIEWS}.{ref.get(REF)}"
        m = dcp_meta.get(flat)
        size = getattr(m, "size", None)
        if size is None:
            raise CheckpointCorruptError(f"{what}: meta.pt refers to sharded data {flat!r} (at {path}) that the "
                                         "directory does not hold; the directory was modified or mixed with another "
                                         "save")
        key = str(ref.get("key"))
        _check(key, size, index, f"{what} at {path}")
        if index.mine(key):  # a TP-split key: this TP rank's slice of the global tensor, whatever the save's mesh
            split = index.entries[index.entries[key].primary].chunk is not None
            req[flat] = index.fragment_request(key, m.properties.dtype) if split else placeholder(m)
    return req


def localize_views(rest: Any, index: KeyIndex, what: str, read: Optional[Mapping[str, Any]] = None,
                   records: Sequence[Mapping[str, Any]] = ()) -> Any:
    """This rank's views in a loaded checkpoint: the references of a directory's ``meta.pt``
    (their data in ``read``, from ``read_refs``) and the recorded paths of a file."""
    if read is not None:
        def fn(path: tuple, ref: Any) -> Any:
            key = str(ref["key"])
            flat = f"{VIEWS}.{ref[REF]}"
            if flat in read:
                return read[flat]
            return _empty(index, key)

        rest = _map(rest, fn)
    for rec in records:
        path = tuple(rec["path"])
        if path[0] == "state_dict":  # the model entries: loaded into the model (and ``state_view``)
            continue
        node = _parent(rest, path)
        if isinstance(node[path[-1]], torch.Tensor):
            node[path[-1]] = _local(str(rec["key"]), node[path[-1]], index, f"{what} at {path}")
    return rest


# ---------------------------------------------------------------------- converting (one process)
def _parent(obj: Any, path: tuple) -> Any:
    for part in path[:-1]:
        obj = obj[part]
    return obj


def refs_to_whole(meta: Any, read: Mapping[str, torch.Tensor]) -> tuple[Any, list[dict[str, Any]]]:
    """Directory -> file: every reference in ``meta`` replaced by its whole tensor (``read``: flat
    DCP key -> tensor), and the records of their paths for the file's layout."""
    records = []

    def fn(path: tuple, ref: Any) -> Any:
        records.append({"path": list(path), "key": str(ref["key"])})
        return read[f"{VIEWS}.{ref[REF]}"]

    return _map(meta, fn), records


def whole_to_refs(rest: Any, records: Sequence[Mapping[str, Any]]) -> tuple[Any, dict[str, torch.Tensor]]:
    """File -> directory: every recorded whole tensor of ``rest`` (changed in place) replaced by a
    reference; returns it and the DCP payload ({digest: tensor})."""
    payload: dict[str, torch.Tensor] = {}
    for rec in records:
        path = tuple(rec["path"])
        node = _parent(rest, path)
        digest = _digest(path)
        payload[digest] = node[path[-1]]
        node[path[-1]] = _ref(digest, str(rec["key"]))
    return rest, payload


def state_view(values: Mapping[str, Any], from_ck: Mapping[str, str], index: KeyIndex) -> dict[str, Any]:
    """A loaded checkpoint's ``state_dict`` as this rank's view, keyed as in the checkpoint:
    ``values`` (checkpoint key -> what was read; ``None`` where this rank read nothing)."""
    out: dict[str, Any] = {}
    for c, v in values.items():
        e = index.entries.get(from_ck.get(c, c))
        if v is None:
            if e is None:
                continue
            v = _empty(index, e.key)
        elif e is not None and e.owned is not None and not index.mine(e.key):
            v = _empty(index, e.key, v.dtype)
        elif e is not None and e.chunk is not None and tuple(v.shape) == tuple(e.shape):  # a file's whole tensor
            v = index.narrow(e.key, v).contiguous()
        out[c] = v
    return out
