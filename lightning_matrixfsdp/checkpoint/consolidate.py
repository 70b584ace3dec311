"""Convert between the two checkpoint formats, in one process, without a GPU or a process group.

    python -m lightning_matrixfsdp.consolidate IN OUT
    python -m lightning_matrixfsdp.consolidate IN OUT --format safetensors [--strip-prefix model.]

* ``IN`` a directory (this package's distributed checkpoint, or one written by
  Lightning's ``ModelParallelStrategy`` with FSDP2) -> ``OUT`` one consolidated
  Lightning checkpoint file that plain ``torch.load`` + ``load_state_dict`` read.
  Tied weights appear under every name the layout sidecar records.
* ``IN`` a file (a consolidated Lightning checkpoint, or a plain ``state_dict``)
  -> ``OUT`` a distributed checkpoint directory that any world size can load.
* ``--format safetensors``: ``IN`` either -> the weights as one ``model.safetensors`` for
  Hugging Face ``from_pretrained`` (``lightning_matrixfsdp.checkpoint.export``).

Why a separate tool: exporting for inference, or moving a run between formats,
should not need the job's cluster.  The consolidated file holds every tensor, so
this process needs about the checkpoint's size in memory (``torch.save`` writes
one object); the file -> directory direction reads the input memory-mapped.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.agree import single_process_quiet
from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError
from lightning_matrixfsdp.checkpoint.export import DTYPES, export_safetensors, model_order
from lightning_matrixfsdp.checkpoint.formats import from_native, hparams, nest, parse_dcp, placeholder, to_native
from lightning_matrixfsdp.checkpoint.integrity import file_records
from lightning_matrixfsdp.checkpoint.load import meta_required, open_dcp, read_dcp, read_file, read_meta
from lightning_matrixfsdp.checkpoint.save import check_target, new_partial, publish, remove_stale, write_file
from lightning_matrixfsdp.checkpoint.sidecar import META_NAME, SIDECAR_NAME, single_writer_layout
from lightning_matrixfsdp.checkpoint.views import REF, VIEWS, find_refs, refs_to_whole, whole_to_refs

__all__ = ["TRAINING_STATE_KEYS", "convert", "dcp_to_file", "file_to_dcp", "main", "read_directory"]

#: What ``--weights-only`` drops from a Lightning checkpoint: everything only resuming training
#: needs. The epoch and global step stay, as in Lightning's own weights-only checkpoints.
TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "loops", "callbacks")


def dcp_to_file(src: Path, dst: Path, weights_only: bool = False, safe: bool = True, verify: bool = True) -> None:
    """A DCP directory -> one Lightning checkpoint file with full tensors."""
    write_file(read_directory(src, weights_only, safe, verify), Path(dst))


def read_directory(src: Path, weights_only: bool = False, safe: bool = True, verify: bool = True) -> dict[str, Any]:
    """A DCP directory as the one Lightning checkpoint (a dict of full tensors on the CPU) that
    :func:`dcp_to_file` writes; in this process, without a process group."""
    src = Path(src)
    md, side = open_dcp(src, verify)
    model_keys = list(parse_dcp(md, []).model)
    ck = parse_dcp(md, model_keys)  # second pass: optimizer keys can be split even without planner data
    flats = [f for f, _ in ck.model.values()]
    if not weights_only:
        flats += [f for per in ck.state.values() for items in per.values() for _, f, _ in items]
        flats += [f for gs in ck.groups.values() for g in gs.values() for f in g.values()]
    out: dict[str, Any] = {}
    if (src / META_NAME).is_file():
        out.update(read_meta(src, weights_only=safe))
    elif meta_required(side, ck):
        raise CheckpointCorruptError(f"{src / META_NAME} is missing: the file would lack the epoch, global step, "
                                     "loops and LR schedulers; restore it or convert an intact copy")
    if weights_only:
        for k in TRAINING_STATE_KEYS:
            out.pop(k, None)
    # sharded tensors outside the model state (a weight-averaging callback's averaged model): whole in the file
    flats += [f"{VIEWS}.{ref[REF]}" for _, ref in find_refs(out)]
    missing = [f for f in flats if f not in md.state_dict_metadata]
    if missing:
        raise CheckpointCorruptError(f"{src}: {META_NAME} refers to data the directory does not hold: {missing[:5]}")
    req: dict[str, Any] = {f: placeholder(md.state_dict_metadata[f]) for f in flats}
    read_dcp(req, src, no_dist=True)
    out, views = refs_to_whole(out, req)
    sd = {k: req[f] for k, (f, _) in ck.model.items()}
    for key, p in ((side or {}).get("params") or {}).items():  # tied weights: every name the model has
        if isinstance(p, Mapping) and p.get("alias_of") in sd and key not in sd:
            sd[key] = sd[p["alias_of"]]
    out["state_dict"] = {k: sd[k] for k in model_order(sd, side)}
    if not weights_only and ck.groups:
        states = []
        for i in range(1 + max(ck.groups)):
            gs = ck.groups.get(i, {})
            groups = [{h: req[f] for h, f in gs[j].items()} for j in sorted(gs)]
            state = {fqn: nest((tail, req[f]) for tail, f, _ in items) for fqn, items in ck.state.get(i, {}).items()}
            names = [list(g.get("params") or []) for g in groups]
            states.append(to_native(state, [hparams(g) for g in groups], names))
        out["optimizer_states"] = states
    else:
        out.pop("optimizer_states", None)
    if weights_only:
        for k in TRAINING_STATE_KEYS:
            out.pop(k, None)
    if side is not None or views:
        out["matrix_fsdp_layout"] = {**(side or {}), **({"views": views} if views else {})}
    return out


def file_to_dcp(src: Path, dst: Path, weights_only: bool = False, safe: bool = True, verify: bool = True,
                checksums: bool = True) -> None:
    """A consolidated Lightning checkpoint (or a plain ``state_dict``) -> a distributed checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    src, dst = Path(src), Path(dst)
    ck, lightning, layout = read_file(src, verify, safe)
    full_sd = dict(ck["state_dict"] if lightning else ck)
    sd = dict(full_sd)
    for key, p in ((layout or {}).get("params") or {}).items():  # tied weights are stored once, by their first name
        if isinstance(p, Mapping) and key in sd and p.get("alias_of") in sd and p["alias_of"] != key:
            del sd[key]
    converted: dict[str, Any] = {"state_dict": sd}
    rest: dict[str, Any] = {}
    if lightning:
        rest = {k: v for k, v in ck.items() if k not in ("state_dict", "optimizer_states", "matrix_fsdp_layout")}
        if weights_only:
            for k in TRAINING_STATE_KEYS:
                rest.pop(k, None)
        records = [r for r in (layout or {}).get("views") or () if _holds(rest, r["path"])]
        rest, views = whole_to_refs(rest, records)
        if views:
            converted[VIEWS] = views
    classes = [o.get("class") for o in (layout or {}).get("optimizers", [])]
    if lightning and not weights_only:
        for i, native in enumerate(ck.get("optimizer_states") or []):
            groups, state = from_native(native)  # needs param_names: this package always writes them
            converted[f"optimizer_{i}"] = {"state": state, "param_groups": groups}
    check_target(dst)
    remove_stale(dst, published=False)
    tmp = new_partial(dst)
    tmp.mkdir(parents=True)
    try:
        with single_process_quiet():
            dcp.save(converted, storage_writer=FileSystemWriter(str(tmp)), planner=DefaultSavePlanner(), no_dist=True)
        if lightning:
            torch.save(rest, tmp / META_NAME)
        side = single_writer_layout(full_sd, [converted[k] for k in converted if k.startswith("optimizer_")],
                                    classes, layout)
        side["files"] = file_records(tmp, [p.name for p in tmp.iterdir()], checksums, collective=False)
        (tmp / SIDECAR_NAME).write_text(json.dumps(side, indent=1, default=str))
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_stale(dst)

def _holds(obj: Any, path: Sequence[Any]) -> bool:
    """Whether ``obj`` has an entry at ``path`` (a recorded view may sit in a dropped section)."""
    for part in path:
        try:
            obj = obj[part]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def convert(src: Path, dst: Path, weights_only: bool = False, safe: bool = True, verify: bool = True) -> str:
    """Convert ``src`` to the other format at ``dst``; returns the direction taken."""
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if src.resolve() == dst.resolve():
        raise ValueError("IN and OUT must differ")
    if src.is_dir():
        dcp_to_file(src, dst, weights_only, safe, verify)
        return "directory -> file"
    file_to_dcp(src, dst, weights_only, safe, verify)
    return "file -> directory"


#: ``--format`` values; leaving it out converts between the directory and the file format.
FORMATS = ("safetensors",)
_EXPORT_OPTIONS = ("strip_prefix", "add_prefix", "dtype", "config")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of ``python -m lightning_matrixfsdp.consolidate``."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_matrixfsdp.consolidate",
        description="Convert a distributed checkpoint directory to one consolidated file, or back; or export "
                    "its weights as model.safetensors for Hugging Face from_pretrained (--format safetensors).")
    parser.add_argument("src", metavar="IN", type=Path, help="checkpoint directory or file")
    parser.add_argument("dst", metavar="OUT", type=Path,
                        help="where to write the other format; with --format safetensors a directory (receives "
                             "model.safetensors) or a file path ending in .safetensors")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="safetensors: export the weights for Hugging Face (leave out to convert between the "
                             "directory and the file format)")
    parser.add_argument("--weights-only", action="store_true",
                        help="keep the weights only: drop optimizer states, LR schedulers, loops and callbacks "
                             "(e.g. for inference; implied by --format safetensors)")
    parser.add_argument("--strip-prefix", default=None, metavar="PREFIX",
                        help="safetensors: export only the keys starting with PREFIX, without it (e.g. 'model.' "
                             "for a LightningModule holding the Hugging Face model as self.model)")
    parser.add_argument("--add-prefix", default=None, metavar="PREFIX",
                        help="safetensors: put PREFIX in front of every exported name (after --strip-prefix)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="safetensors: cast floating-point weights (default: as stored)")
    parser.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="safetensors: copy this config.json (or the one in directory PATH) next to the export")
    parser.add_argument("--unsafe-load", action="store_true",
                        help="torch.load with weights_only=False (only for trusted files holding arbitrary objects)")
    parser.add_argument("--no-verify", action="store_true", help="do not check the input's checksums")
    args = parser.parse_args(argv)
    if args.format is None:
        given = [f"--{o.replace('_', '-')}" for o in _EXPORT_OPTIONS if getattr(args, o) is not None]
        if given:
            parser.error(f"{', '.join(given)} only apply with --format safetensors")
        direction = convert(args.src, args.dst, args.weights_only, safe=not args.unsafe_load,
                            verify=not args.no_verify)
        print(f"{args.src} -> {args.dst} ({direction})")
        return 0
    res = export_safetensors(args.src, args.dst, strip_prefix=args.strip_prefix, add_prefix=args.add_prefix,
                             dtype=args.dtype, config=args.config, safe=not args.unsafe_load,
                             verify=not args.no_verify)
    print(f"{args.src} -> {res.path} ({len(res.names)} tensors)")
    for alias, stored in res.tied.items():
        print(f"  tied: {alias} is stored once, as {stored}")
    if res.dropped:
        more = f" ... ({len(res.dropped)} in all)" if len(res.dropped) > 5 else ""
        print(f"  left out (not under --strip-prefix {args.strip_prefix!r}): {', '.join(res.dropped[:5])}{more}")
    if res.config is not None:
        print(f"  config: {res.config}")
    elif not (res.path.parent / "config.json").is_file():
        print(f"  note: from_pretrained({str(res.path.parent)!r}) needs a config.json there (--config PATH)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
