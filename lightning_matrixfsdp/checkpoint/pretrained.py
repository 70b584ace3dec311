"""Pretrained weights straight into their owners: fine-tuning without a full copy per rank.

``from_pretrained`` builds the whole model on every rank before the strategy shards it, so
each rank holds the full checkpoint in host memory once. Here the model is built with its
parameters on the meta device (:func:`meta_init`), ``matrix_shard`` (or the strategy) gives
each owner its uninitialized whole tensors, and :func:`load_pretrained` reads from the
safetensors files only the tensors this rank owns, plus the buffers every rank holds,
straight into the resident tensors (``readinto``, no memory map, no second copy when the
dtypes agree). A checkpoint of this library (directory or consolidated file) goes through
``load_weights``, which reads the owned tensors only as well.

A part of a tensor along its first dimension (an expert-parallel rank's experts, a planner's
block of a stack, a TP row fragment) is read alone, as the byte range of its rows; a TP
fragment along another dimension reads the whole tensor (one at a time, into a temporary CPU
tensor) and keeps its slice. Hugging Face MoE files that keep one matrix per expert are read
expert by expert into the rows of the stacks (``expert_files.py``).

Every step is agreed across ranks (``agree``): keys, shapes and dtypes are checked against
the files' headers before any tensor is read, and an error on one rank is raised on all.
"""
from __future__ import annotations

import contextlib
import json
import struct
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from lightning_matrixfsdp.checkpoint.agree import agree, agreed_path, warn
from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError, CheckpointKeyError, CheckpointMismatchError
from lightning_matrixfsdp.checkpoint.expert_files import check_fused, file_names, find_fused, fused_reads
from lightning_matrixfsdp.checkpoint.load import load_weights
from lightning_matrixfsdp.checkpoint.save import PathLike
from lightning_matrixfsdp.runtime.views.checkpoint import Chunked, Holding, ModelView, model_view_of, note_loaded

__all__ = ["INDEX_NAME", "SAFETENSORS_NAME", "PretrainedLoad", "load_pretrained", "meta_init", "safetensors_layout"]

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CHUNK = 64 << 20  # bytes per readinto call: bounded syscalls, no bound on the tensor


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules with their *parameters* on the meta device and their buffers real.

    ``torch.device("meta")`` would put buffers there too, and a buffer computed in
    ``__init__`` that no checkpoint holds (a rotary embedding's ``inv_freq``) would lose its
    value; here it keeps it, as with accelerate's ``init_empty_weights(include_buffers=False)``.
    Not thread-safe: it patches ``nn.Module.register_parameter`` while the block runs."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kept = module._parameters[name]
            attrs = dict(kept.__dict__)  # marks a library set on it (e.g. Hugging Face's)
            moved = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            moved.__dict__.update(attrs)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, from its header."""

    file: Path
    dtype: str           # the file's dtype code ("F32", "BF16", ...)
    shape: tuple[int, ...]
    begin: int           # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did on this rank."""

    files: tuple[str, ...]          # the safetensors files (or the checkpoint) read from
    read: tuple[str, ...]           # the file keys this rank read (its owned tensors and the buffers)
    bytes_read: int
    missing: tuple[str, ...]        # model keys left as they were (strict=False only)
    unexpected: tuple[str, ...]     # file keys no model key took (strict=False only)


#: one read of a rank: (file entry, file key, destination, the part of the whole a TP fragment takes)
Read = tuple[Entry, str, torch.Tensor, Optional[tuple[int, int, int]]]


def _header(file: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file: 8 bytes little-endian header length, JSON header, data."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointCorruptError(f"{file}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointCorruptError(f"{file}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointCorruptError(f"{file}: the safetensors header is not JSON: {e}") from None
    out = {}
    for key, rec in header.items():
        if key == "__metadata__":
            continue
        begin, end = (8 + n + int(o) for o in rec["data_offsets"])
        dtype, shape = rec["dtype"], tuple(int(s) for s in rec["shape"])
        if dtype not in _DTYPES:
            raise CheckpointMismatchError(f"{file}: tensor {key!r} has dtype {dtype}, which this loader does not read")
        want = _DTYPES[dtype].itemsize * (int(torch.Size(shape).numel()))
        if end - begin != want or end > size:
            raise CheckpointCorruptError(f"{file}: tensor {key!r} ({dtype}, {list(shape)}) spans bytes {begin}-{end} "
                                         f"of a {size}-byte file; expected {want} bytes inside it")
        out[key] = Entry(file, dtype, shape, begin, end)
    return out


def safetensors_layout(path: PathLike) -> dict[str, Entry]:
    """Every tensor of a Hugging Face checkpoint (a directory with ``model.safetensors`` or
    ``model.safetensors.index.json``, or one ``.safetensors`` file), from the headers only."""
    path = Path(path)
    if path.is_file():
        return _header(path)
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointCorruptError(f"{path / INDEX_NAME}: not a safetensors index ({e!r})") from None
        out: dict[str, Entry] = {}
        for name in sorted(set(weight_map.values())):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path / INDEX_NAME} lists {name}, which is not in {path}")
            out.update(_header(path / name))
        absent = sorted(k for k in weight_map if k not in out)
        if absent:
            raise CheckpointCorruptError(f"{path / INDEX_NAME} maps {absent[:5]} to files that do not hold them")
        return out
    if (path / SAFETENSORS_NAME).is_file():
        return _header(path / SAFETENSORS_NAME)
    raise FileNotFoundError(f"{path} holds neither {SAFETENSORS_NAME} nor {INDEX_NAME}")


def _source(path: Path) -> str:
    """'safetensors' (a Hugging Face directory or file) or 'checkpoint' (this library's, or any torch file)."""
    if not path.exists():
        raise FileNotFoundError(f"pretrained weights {path} do not exist")
    if path.is_file():
        return "safetensors" if path.suffix == ".safetensors" else "checkpoint"
    if (path / INDEX_NAME).is_file() or (path / SAFETENSORS_NAME).is_file():
        return "safetensors"
    if (path / ".metadata").is_file():
        return "checkpoint"
    raise FileNotFoundError(f"{path} holds neither {SAFETENSORS_NAME}, {INDEX_NAME} nor a checkpoint's .metadata "
                            "(PyTorch .bin weights: convert them to safetensors first)")


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a ``state_dict`` holds, by key (every rank holds them whole)."""
    out = {}
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = b
    return out


def _listing(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _match(module: nn.Module, view: ModelView, layout: Mapping[str, Entry], prefix: str, strict: bool,
           where: str) -> tuple[list[Read], list[str], list[str], list[int]]:
    """(this rank's reads as (entry, file key, destination, part), missing model keys, unexpected file
    keys, the ``ident`` of every parameter the files hold). ``part``: ``(dim, start, length)`` of the
    file's whole tensor that a TP fragment takes."""
    if not view.roots:
        raise CheckpointMismatchError("load_pretrained needs a module sharded by matrix_shard or the strategy "
                                      "(call it after sharding: in on_fit_start, or after fabric.setup_module)")
    reads: list[Read] = []
    missing: list[str] = []
    blank: list[str] = []  # missing, and uninitialized memory (meta-built, no reset_parameters)
    loaded: list[int] = []
    used: set[str] = set()
    problems: list[str] = []

    def take(key: str, shape: tuple[int, ...], dtype: torch.dtype, dst: Optional[torch.Tensor],
             part: Optional[tuple[int, int, int]] = None) -> None:
        e = layout[key]
        used.add(key)
        if e.shape != tuple(shape):
            problems.append(f"{key!r}: {list(e.shape)} in {e.file.name}, {list(shape)} in the model")
        elif _DTYPES[e.dtype].is_floating_point != dtype.is_floating_point and _DTYPES[e.dtype] != dtype:
            problems.append(f"{key!r}: {e.dtype} in {e.file.name}, {dtype} in the model (no cast between "
                            "integer and floating point)")
        elif dst is not None:  # a chunk (``shape`` is the global one) takes its slice of the whole
            reads.append((e, key, dst, part))

    seen: set[int] = set()
    for pv in view.params.values():
        if id(pv) in seen:
            continue
        seen.add(id(pv))
        names = [n[len(prefix):] for n in pv.names if n.startswith(prefix)]
        if not names:
            continue
        found = [n for n in names if n in layout]
        if not found:  # a Hugging Face file's own name for it (Mixtral's block_sparse_moe)
            found = [a for n in names for a in file_names(n)[1:] if a in layout]
        fused = None if found else find_fused(names, pv.shape, layout)  # experts held one matrix per expert
        if fused is not None:
            used.update(fused.used)
            problems.extend(check_fused(fused, pv.shape, pv.dtype, layout, _DTYPES))
            if not problems and pv.local is not None:
                reads.extend(fused_reads(fused, layout, pv.local, _part(pv.holding)))
        elif found:
            used.update(found[1:])  # a tie stored twice: the first name in model order wins, as a tie does
            take(found[0], pv.shape, pv.dtype, pv.local, _part(pv.holding))
        else:
            missing.append(" = ".join(names))  # tied names: any one of them in the file loads it
            if not pv.initialized:
                blank.append(missing[-1])
            continue
        loaded.append(pv.ident)
    # pipeline parallelism: the other stages' keys are theirs to read (and to miss); this stage expects them
    used.update(k[len(prefix):] for k in view.elsewhere if k.startswith(prefix))
    for key, buf in _persistent_buffers(module).items():
        if key.startswith(prefix) and key not in view.elsewhere:
            name = key[len(prefix):]
            if name in layout:
                take(name, tuple(buf.shape), buf.dtype, buf)
            else:
                missing.append(name)
    unexpected = sorted(k for k in layout if k not in used)
    if problems:
        raise CheckpointMismatchError(f"{where} does not fit the model: " + "; ".join(problems[:12])
                                      + (f"; and {len(problems) - 12} more" if len(problems) > 12 else ""))
    if blank or (strict and (missing or unexpected)):
        _refuse_keys(where, layout, prefix, missing, unexpected, blank)
    return reads, missing, unexpected, loaded


def _refuse_keys(where: str, layout: Mapping[str, Entry], prefix: str, missing: list[str], unexpected: list[str],
                 blank: list[str]) -> None:
    """The key error: what is missing and unexpected, and what to do. ``strict=False`` is offered only
    where every missing key holds values already; keys left uninitialized are refused even with it."""
    parts = []
    if missing:
        parts.append(f"missing from it (in the model, not in the files): {_listing(missing)}")
    if unexpected:
        files = sorted({layout[k].file.name for k in unexpected})
        parts.append(f"unexpected (in {', '.join(files)}, not in the model): {_listing(unexpected)}")
    hint = f" (prefix={prefix!r} is put in front of every file key)" if prefix else " (a prefix= argument?)"
    if not blank:
        raise CheckpointKeyError(f"{where}: " + "; ".join(parts) + hint + "; strict=False loads the rest")
    raise CheckpointKeyError(
        f"{where}: " + "; ".join(parts) + hint + f". {_listing(blank)} would stay uninitialized memory: the model was "
        "built on the meta device (meta_init, empty_init=True) and their modules have no reset_parameters to fill "
        "them (Hugging Face experts, routers and norms), so only the files can; strict=False does not load "
        "without them. Give files that hold them (a per-expert Mixtral/Qwen MoE file is read as such; check the "
        "names), or build those modules with real tensors")


def _part(holding: Holding) -> Optional[tuple[int, int, int]]:
    """``(dim, start, length)`` of the whole tensor this rank holds: a TP fragment's (at its TP rank),
    an expert slice's or a planner block's (at its expert-parallel or shard rank); None: all."""
    return holding.bounds() if isinstance(holding, Chunked) else None


def _read_into(entry: Entry, dst: torch.Tensor, f: Any, part: Optional[tuple[int, int, int]] = None) -> int:
    """Read one tensor's bytes into ``dst``: in place when it is a contiguous CPU tensor of the file's
    dtype, else into one temporary CPU tensor that ``copy_`` casts and moves (as ``.to(dtype)``).
    ``part`` ``(dim, start, length)``: ``dst`` takes that slice of the file tensor; along the first
    dimension only its rows are read (the experts of a rank, a row fragment), along another the
    whole tensor is read and narrowed."""
    if part is not None and part[0] == 0 and entry.shape:  # leading rows: one contiguous byte range, read alone
        _, start, length = part  # (an expert-parallel rank's experts, a planner block, a row fragment)
        row = (entry.end - entry.begin) // entry.shape[0] if entry.shape[0] else 0
        entry = replace(entry, shape=(length, *entry.shape[1:]), begin=entry.begin + start * row,
                        end=entry.begin + (start + length) * row)
        part = None
    src_dtype = _DTYPES[entry.dtype]
    direct = part is None and dst.device.type == "cpu" and dst.dtype == src_dtype and dst.is_contiguous()
    target = dst if direct else torch.empty(entry.shape, dtype=src_dtype)
    raw = target.detach().reshape(-1).view(torch.uint8).numpy()
    if sys.byteorder != "little" and src_dtype.itemsize > 1:
        raise CheckpointMismatchError("safetensors files are little-endian; this host is not")
    f.seek(entry.begin)
    done, total = 0, entry.end - entry.begin
    view = memoryview(raw)
    while done < total:
        n = f.readinto(view[done:min(total, done + _CHUNK)])
        if not n:
            raise CheckpointCorruptError(f"{entry.file}: ended {total - done} bytes early")
        done += n
    if not direct:
        with torch.no_grad():
            dst.copy_(target if part is None else target.narrow(*part))
    return total


def _read(reads: list[Read]) -> int:
    """Every read of this rank, file by file, in file order (one open per file)."""
    total = 0
    by_file: dict[Path, list[Read]] = {}
    for r in reads:
        by_file.setdefault(r[0].file, []).append(r)
    for file, items in by_file.items():
        with open(file, "rb", buffering=0) as f:
            for entry, _, dst, part in sorted(items, key=lambda r: r[0].begin):
                total += _read_into(entry, dst, f, part)
    return total


def load_pretrained(module: nn.Module, path: PathLike, *, prefix: str = "", strict: bool = True,
                    verify: bool = True) -> PretrainedLoad:
    """Load pretrained weights into a sharded ``module``, each rank reading only what it holds.  Collective.

    ``path``: a Hugging Face directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), one ``.safetensors`` file, or a checkpoint of this
    library (directory or file; read by ``load_weights``, owned tensors only, ``verify``
    checks its checksums). ``prefix`` goes in front of every file key to give the module's
    key: ``"model."`` for a LightningModule holding the Hugging Face model as ``self.model``.
    Model keys outside ``prefix`` are not looked at.

    Tied parameters load from whichever of their names the files hold (Hugging Face stores a
    tie once). Floating-point tensors are cast to the model's dtype (``Tensor.copy_``, the
    cast ``from_pretrained`` makes). Keys are matched exactly, except for Hugging Face MoE
    files that keep one matrix per expert (Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``,
    Qwen-MoE's ``experts.N.gate_proj/up_proj/down_proj``): they are joined into the model's
    ``gate_up_proj``/``down_proj`` stacks as transformers joins them, each rank reading only
    the experts it holds (``expert_files.py``). Missing or unexpected keys raise
    :class:`CheckpointKeyError` naming them and the file (``strict=False`` warns and leaves
    missing ones as they are, unless one of them is uninitialized memory: a parameter of a
    meta-built module without ``reset_parameters``, which is refused even then), a shape or
    dtype that does not fit raises :class:`CheckpointMismatchError` naming the key and the
    file; both before any tensor is read. A file that fails while being read leaves the
    model partly loaded."""
    path = agreed_path(path, prefix=prefix, strict=bool(strict), verify=bool(verify))
    if agree(_source, path) == "checkpoint":
        if prefix:
            raise ValueError("prefix= applies to Hugging Face safetensors weights; a checkpoint of this library "
                             "is keyed like the module it was saved from")
        load_weights(module, path, strict=strict, verify=verify)
        return PretrainedLoad((str(path),), (), 0, (), ())
    layout = agree(safetensors_layout, path)
    view = model_view_of(module)  # collective under replica_split: every rank, outside agree's step
    reads, missing, unexpected, loaded = agree(_match, module, view, layout, prefix, bool(strict), str(path))
    if missing:
        warn(f"load_pretrained: {len(missing)} model key(s) not in {path} keep their values: {_listing(missing)}")
    if unexpected:
        warn(f"load_pretrained: {len(unexpected)} key(s) of {path} not in the model: {_listing(unexpected)}")
    nbytes = agree(_read, reads)
    note_loaded(module, loaded)  # they hold values now: a later load may leave them out
    files = tuple(sorted({str(e.file) for e in layout.values()}))
    return PretrainedLoad(files, tuple(r[1] for r in reads), nbytes, tuple(missing), tuple(unexpected))
