"""The layout sidecar ``matrix_fsdp_layout.json``: what it records, how it is read and checked.

It records who owned what (shape, dtype, owner, role, tied aliases), the plans, the
optimizers, the files the save wrote (sizes and checksums) and the versions. The data
is located by name, so loading does not need it; when present it is checked against
the data beside it, and it is what tells a load which files must exist with which
contents, which parameters changed role, and which aliases a converted file carries.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.agree import world
from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError
from lightning_matrixfsdp.checkpoint.formats import DcpEntries, dtype_name
from lightning_matrixfsdp.checkpoint.index import KeyIndex

__all__ = ["FORMAT", "FORMAT_VERSION", "META_NAME", "SIDECAR_NAME", "check_sidecar", "layout_change", "layout_dict",
           "read_sidecar", "roles_of", "saved_mesh", "single_writer_layout", "versions"]

SIDECAR_NAME = "matrix_fsdp_layout.json"
META_NAME = "meta.pt"  # Lightning's marker of a sharded checkpoint directory (fabric.utilities.load._METADATA_FILENAME)
FORMAT = "lightning_matrixfsdp.checkpoint"
# Later additions (``files``) are optional fields: readers of version 1 ignore them, and
# this reader accepts sidecars without them.
FORMAT_VERSION = 1


def versions() -> dict[str, str]:
    """Versions of the packages that wrote a checkpoint."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": str(torch.__version__)}
    for dist_name, key in (("lightning-matrixfsdp", "lightning_matrixfsdp"), ("lightning", "lightning")):
        try:
            out[key] = version(dist_name)
        except PackageNotFoundError:
            pass
    return out


def _optimizers(optimizers: Sequence[Mapping[str, Any]], classes: Sequence[Optional[str]]) -> list[dict[str, Any]]:
    return [{"class": c,
             "param_groups": [list(g.get("param_names", g["params"])) for g in o.get("param_groups", [])]}
            for c, o in zip(list(classes) + [None] * len(optimizers), optimizers)]


def layout_dict(index: KeyIndex, optimizers: Sequence[Mapping[str, Any]] = (), classes: Sequence[str] = (),
                files: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What the sidecar records: who owned what, shapes, dtypes, roles, plans, optimizers, files, versions."""
    size = world()[1]
    first = index.roots[0] if index.roots else None
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": size,
        "shard_span": first.span if first else 1,
        "replicate": first.replicate if first else size,
        "planner": first.plan.planner if first else None,
        "plans": index.plan_records(),  # under pipeline parallelism every stage's, with its "stage"
        # "stepper" (replica_split): the replica whose rank wrote the parameter's optimizer state
        # "mesh": the (data-parallel, tensor-parallel) sizes; "tp": the layout of a key saved in chunks
        # (shape is global): a TP fragment's, and an expert stack's chunks by expert under the same name
        # (the format's field, kept so that older checkpoints and readers agree)
        "mesh": index.mesh(),
        "params": _own_params(index),
        **_pipeline(index),
        "optimizers": _optimizers(optimizers, classes),
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if files is not None:
        out["files"] = dict(files)
    return out


def _pipeline(index: KeyIndex) -> dict[str, Any]:
    """Under pipeline parallelism: the pipeline size, and every stage's tensors in ``params`` (global
    rank 0 writes the sidecar, and its index holds its own stage's only), in model order."""
    if index.pp_size == 1:
        return {}
    remote = {k: {"shape": list(e.shape), "dtype": dtype_name(e.dtype), "owner": e.owner, "role": e.role,
                  **({"tp": e.layout} if e.layout is not None else {}),
                  **({"alias_of": e.primary} if e.primary != k else {})}
              for k, e in index.remote.items()}
    merged = {**_own_params(index), **remote}
    return {"pipeline": {"size": index.pp_size}, "params": {k: merged[k] for k in sorted(merged, key=index.position)}}


def _own_params(index: KeyIndex) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(e.shape), "dtype": dtype_name(e.dtype),
                "owner": e.owned.owner if e.owned is not None else None, "role": e.role,
                **({"stepper": e.stepper} if e.stepper is not None else {}),
                **({"tp": e.chunk.layout.to_dict()} if e.chunk is not None else {}),
                **({"alias_of": e.primary} if e.primary != k else {})}
            for k, e in index.entries.items()}


def single_writer_layout(sd: Mapping[str, Any], optimizers: Sequence[Mapping[str, Any]],
                         classes: Sequence[Optional[str]], source: Optional[Mapping[str, Any]] = None
                         ) -> dict[str, Any]:
    """The sidecar of a directory made from one file: one writer that owned everything.
    ``source``: the file's own layout record, whose roles and tied aliases carry over."""
    params_src = (source or {}).get("params") or {}
    params: dict[str, dict[str, Any]] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        src = params_src.get(k) if isinstance(params_src.get(k), Mapping) else {}
        params[k] = {"shape": list(v.shape), "dtype": dtype_name(v.dtype), "owner": 0, "role": src.get("role")}
        if src.get("alias_of") in sd and src["alias_of"] != k:
            params[k]["alias_of"] = src["alias_of"]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "world_size": 1, "shard_span": 1, "replicate": 1,
        "planner": None, "plans": [], "params": params, "optimizers": _optimizers(optimizers, classes),
        "versions": versions(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "converted_from": "file",
    }


def read_sidecar(path: Path) -> dict[str, Any]:
    """Parse and check the sidecar of directory ``path``; any defect is a :class:`CheckpointCorruptError`."""
    f = Path(path) / SIDECAR_NAME
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
        files = d.get("files")
        if files is not None and not (isinstance(files, dict) and all(
                isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32", []), list)
                for r in files.values())):
            problems.append("'files' is not a map of file name -> {size, crc32}")
    if problems:
        raise CheckpointCorruptError(f"layout sidecar {f} is corrupted: " + "; ".join(problems))
    return d


def check_sidecar(side: Mapping[str, Any], ck: DcpEntries, what: str) -> None:
    """The sidecar must describe the data next to it."""
    specs = ck.specs()
    for key, p in side["params"].items():
        if "alias_of" in p:
            continue
        s = specs.get(key)
        if s is None or s[0] != "t" or list(s[1]) != list(p["shape"]) or dtype_name(s[2]) != p["dtype"]:
            raise CheckpointCorruptError(
                f"{what}: the layout sidecar does not match the saved data at {key!r} (sidecar "
                f"{p.get('shape')}/{p.get('dtype')}, data {s[1:] if s else 'absent'}); the directory was modified "
                "or mixed with another save")


def saved_mesh(side: Mapping[str, Any]) -> dict[str, Any]:
    """The (data-parallel, tensor-parallel) mesh a sidecar records; one without a mesh was written
    without tensor parallelism."""
    mesh = side.get("mesh")
    if isinstance(mesh, Mapping):
        out = {"data_parallel": mesh.get("data_parallel"), "tensor_parallel": mesh.get("tensor_parallel", 1)}
        pp = mesh.get("pipeline_parallel", 1)
        return {**out, "pipeline_parallel": pp} if pp != 1 else out
    return {"data_parallel": side.get("world_size"), "tensor_parallel": 1}


def layout_change(side: Mapping[str, Any], index: KeyIndex) -> str:
    """What a load logs: the same layout, or what it reshards from and to (world, shard span,
    planner and, when they differ, the (data-parallel, tensor-parallel) meshes). Any change loads:
    each rank reads what it holds now, TP fragments as slices of the global tensors."""
    saved, now = saved_mesh(side), index.mesh()
    digests = [p.get("digest") for p in side.get("plans", []) if isinstance(p, Mapping)]
    if digests == [p["digest"] for p in index.plan_records()] and saved == now:
        return "same layout, loading owned tensors"
    first = index.roots[0] if index.roots else None

    def mesh(m: Mapping[str, Any]) -> str:
        pp = f", pipeline_parallel={m['pipeline_parallel']}" if "pipeline_parallel" in m else ""
        return (f"mesh (data_parallel={m['data_parallel']}, tensor_parallel={m['tensor_parallel']}{pp}) "
                if saved != now else "")

    return (f"resharding from {mesh(saved)}world {side.get('world_size')} span {side.get('shard_span')} "
            f"({side.get('planner')}) to {mesh(now)}world {world()[1]} span {first.span if first else 1} "
            f"({first.plan.planner if first else None})")


def roles_of(layout: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """key -> role ("matrix"/"tail") of every sharded parameter a layout record names (``{}``:
    an older or foreign checkpoint without roles)."""
    params = layout.get("params") if isinstance(layout, Mapping) else None
    if not isinstance(params, Mapping):
        return {}
    return {k: p["role"] for k, p in params.items() if isinstance(p, Mapping) and isinstance(p.get("role"), str)}
