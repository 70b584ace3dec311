"""Export a checkpoint's weights as one ``model.safetensors`` for Hugging Face ``from_pretrained``.

    python -m lightning_matrixfsdp.consolidate CKPT OUT --format safetensors --strip-prefix model.

``CKPT`` is a checkpoint directory (DCP + layout sidecar) or a consolidated file (a Lightning
checkpoint or a plain ``state_dict``). Weights only: optimizer state and training metadata stay
behind. safetensors refuses tensors that share storage, so a tied weight is written once,
under its first name in the model's parameter order (the input embedding in Hugging Face
models, as ``save_pretrained`` does); ``from_pretrained`` ties the other name back from the
config's ``tie_word_embeddings``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from lightning_matrixfsdp.checkpoint.formats import parse_dcp, placeholder
from lightning_matrixfsdp.checkpoint.load import open_dcp, read_dcp, read_file
from lightning_matrixfsdp.checkpoint.save import new_partial, publish, remove_stale

__all__ = ["DTYPES", "ExportResult", "SAFETENSORS_NAME", "export_safetensors", "model_order", "read_weights"]

SAFETENSORS_NAME = "model.safetensors"
#: ``--dtype`` choices: floating-point tensors are cast, integer and bool tensors are kept.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_INSTALL = 'pip install "lightning-matrixfsdp[hf]"'


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote."""

    path: Path
    names: list[str]
    #: tied names written once under another name: {left-out name: name written}, as in the checkpoint
    tied: dict[str, str] = field(default_factory=dict)
    #: checkpoint keys outside ``strip_prefix``, left out
    dropped: list[str] = field(default_factory=list)
    config: Optional[Path] = None


def model_order(sd: Mapping[str, Any], side: Optional[Mapping[str, Any]]) -> list[str]:
    """The keys in the model's ``state_dict`` order where the sidecar records it (aliases in place)."""
    recorded = [k for k in ((side or {}).get("params") or {}) if k in sd]
    rest = set(recorded)
    return recorded + [k for k in sd if k not in rest]


def _aliases(layout: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """{tied name: the name it is stored under} from a layout record (sidecar or ``matrix_fsdp_layout``)."""
    params = (layout or {}).get("params") or {}
    return {k: p["alias_of"] for k, p in params.items()
            if isinstance(p, Mapping) and isinstance(p.get("alias_of"), str) and p["alias_of"] != k}


def read_weights(src: Union[str, os.PathLike], safe: bool = True, verify: bool = True
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """The full model ``state_dict`` of a checkpoint directory or file, in model order, and its tied
    names ``{alias: stored name}``. One process, no process group."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if src.is_dir():
        md, side = open_dcp(src, verify)
        model = parse_dcp(md, []).model
        req: dict[str, Any] = {f: placeholder(md.state_dict_metadata[f]) for f, _ in model.values()}
        read_dcp(req, src, no_dist=True)
        sd = {k: req[f] for k, (f, _) in model.items()}
        aliases = _aliases(side)
        for alias, stored in aliases.items():  # DCP holds a tie once: every name the model has, as in a file
            if stored in sd and alias not in sd:
                sd[alias] = sd[stored]
        return {k: sd[k] for k in model_order(sd, side)}, aliases
    ck, lightning, layout = read_file(src, verify, safe)
    return dict(ck["state_dict"]) if lightning else ck, _aliases(layout)


def _storage_key(t: torch.Tensor) -> tuple:
    """Equal for two names of one tensor (same storage, offset, shape, strides): a tie a plain
    ``state_dict`` file keeps without a layout record."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _select(sd: Mapping[str, Any], strip_prefix: Optional[str], add_prefix: Optional[str]
            ) -> tuple[dict[str, str], list[str]]:
    """{checkpoint key: exported name} for the keys under ``strip_prefix``, and the keys left out."""
    if not sd:
        raise ValueError("the checkpoint holds no model weights")
    if strip_prefix:
        chosen = [k for k in sd if k.startswith(strip_prefix)]
        if not chosen:
            first = ", ".join(list(sd)[:5])
            raise ValueError(f"--strip-prefix {strip_prefix!r} matches no key of the checkpoint; its first keys are: "
                             f"{first}")
    else:
        chosen = list(sd)
    names = {k: (add_prefix or "") + k[len(strip_prefix or ""):] for k in chosen}
    return names, [k for k in sd if k not in names]


def _check_tensors(sd: Mapping[str, Any], keys: list[str]) -> None:
    bad = [f"{k} ({type(sd[k]).__name__})" for k in keys if not isinstance(sd[k], torch.Tensor)]
    if bad:
        raise TypeError(f"safetensors holds tensors only; these checkpoint entries are not tensors: "
                        f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}. Leave them out with --strip-prefix "
                        "(only keys under the prefix are exported)")


def _dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in DTYPES:
        return DTYPES[dtype.replace("torch.", "")]
    raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def _config_file(config: Union[str, os.PathLike]) -> Path:
    """A ``config.json`` given as the file or as the directory holding it, checked to be JSON."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--config {config}: no such file (give a config.json or a directory holding one)")
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path} is not a JSON file: {e}") from None
    return path


def _target(dst: Union[str, os.PathLike]) -> Path:
    """OUT ending in ``.safetensors`` is the file; any other OUT is a directory for ``model.safetensors``."""
    dst = Path(dst)
    if dst.suffix == ".safetensors":
        if dst.is_dir():
            raise IsADirectoryError(f"{dst} is a directory; an OUT ending in .safetensors names the file to write")
        return dst
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(f"{dst} is an existing file; OUT is a directory (for {SAFETENSORS_NAME}) "
                                 "or a path ending in .safetensors")
    return dst / SAFETENSORS_NAME


def export_safetensors(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], *,
                       strip_prefix: Optional[str] = None, add_prefix: Optional[str] = None,
                       dtype: Union[None, str, torch.dtype] = None, config: Union[None, str, os.PathLike] = None,
                       safe: bool = True, verify: bool = True) -> ExportResult:
    """Write the weights of checkpoint ``src`` as one safetensors file.

    ``dst``: a path ending in ``.safetensors`` is the file; otherwise a directory that receives
    ``model.safetensors`` (and ``config.json`` when ``config`` is given). ``strip_prefix``
    keeps only the keys that start with it and removes it (a LightningModule's ``model.``);
    ``add_prefix`` is then put in front. ``dtype`` casts floating-point tensors."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(f"--format safetensors needs the safetensors package: {_INSTALL}") from None
    cast = _dtype(dtype)
    cfg = _config_file(config) if config is not None else None
    target = _target(dst)
    if Path(src).resolve() == target.resolve():
        raise ValueError("IN and OUT must differ")
    sd, aliases = read_weights(src, safe=safe, verify=verify)
    names, dropped = _select(sd, strip_prefix, add_prefix)
    _check_tensors(sd, list(names))
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[Any, str] = {}  # tie identity (stored name, storage view) -> exported name
    storages: set[int] = set()
    for key, name in names.items():
        t = sd[key]
        ids = [("name", aliases.get(key, key))]
        if t.numel() and t.untyped_storage().data_ptr():  # empty tensors share no data
            ids.append(("view", _storage_key(t)))
        seen = next((first[i] for i in ids if i in first), None)
        if seen is not None:
            tied[name] = seen
            continue
        first.update((i, name) for i in ids)
        t = t.detach().to("cpu")
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        t = t.contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # safetensors refuses shared storage: views of one tensor that are not ties
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target, published=False)
    tmp = new_partial(target)
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})  # "pt": what from_pretrained expects
        publish(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    remove_stale(target)
    copied = None
    if cfg is not None:
        copied = target.parent / "config.json"
        if cfg.resolve() != copied.resolve():
            shutil.copyfile(cfg, copied)
    return ExportResult(path=target, names=list(tensors), tied=tied, dropped=dropped, config=copied)
