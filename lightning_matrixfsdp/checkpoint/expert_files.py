"""Hugging Face MoE files that keep one matrix per expert, read into the model's fused stacks.

transformers 5 holds the experts of a Mixtral or Qwen3-MoE layer as two stacked parameters,
``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``. The Hub's files, and
what ``save_pretrained`` writes (it converts back on save), keep one matrix per expert and
projection instead, in one of two namings:

* ``experts.{e}.w1.weight`` (gate), ``w3`` (up), ``w2`` (down): Mixtral and its family, whose MoE
  block is also named ``block_sparse_moe`` in the files where the model says ``mlp`` (its router
  ``block_sparse_moe.gate.weight`` included);
* ``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``: Qwen2/Qwen3-MoE and the models
  that share their layout.

On load transformers stacks each projection over the experts in expert order and joins gate
and up along the rows, gate first: ``gate_up_proj[e] = cat(gate_e, up_e)``, ``down_proj[e] =
down_e``, with no transposition (the per-expert ``[out, in]`` matrices are already the stack's
``F.linear`` layout). This module does the same, without building a stack anywhere: each file
tensor is read into its rows of the destination (an owner's whole stack, an expert-parallel
rank's experts, a planner block, a TP fragment), so a rank reads only the experts it holds and
no rank holds a second copy of a stack. Pure: headers in, reads out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = ["FusedStack", "check_fused", "file_names", "find_fused", "fused_reads"]

#: the model name of a module path segment -> its name in the files (Mixtral's MoE block)
RENAMED = ((".mlp.", ".block_sparse_moe."),)
#: a fused stack's parameter name -> the per-expert namings of its pieces, in row order
PIECES: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
    "down_proj": (("w2",), ("down_proj",)),
}


def file_names(name: str) -> list[str]:
    """The names a model key may have in Hugging Face files, the key itself first."""
    out = [name]
    for model, files in RENAMED:
        if model in f".{name}":
            out.append(f".{name}".replace(model, files)[1:])
    return out


@dataclass(frozen=True)
class FusedStack:
    """A stack held per expert in the files: ``keys[e]`` are expert ``e``'s pieces in row order."""

    name: str                           # the model key (without the loader's prefix)
    keys: tuple[tuple[str, ...], ...]   # per expert, the file keys joined along the rows
    missing: tuple[str, ...]            # per-expert keys the files lack

    @property
    def used(self) -> list[str]:
        return [k for ks in self.keys for k in ks]


def find_fused(names: Sequence[str], shape: Sequence[int], layout: Mapping[str, Any]) -> Optional[FusedStack]:
    """The per-expert file keys of the stack ``names`` (its tied names) of ``shape`` ``[E, ...]``,
    or None where the files hold it in no per-expert naming (then it is simply missing)."""
    if len(shape) != 3:
        return None
    for name in names:
        module, _, param = name.rpartition(".")
        for prefix in file_names(module) if module else ():
            for naming in PIECES.get(param, ()):
                keys = tuple(tuple(f"{prefix}.{e}.{piece}.weight" for piece in naming) for e in range(shape[0]))
                if any(k in layout for ks in keys for k in ks):
                    present = tuple(tuple(k for k in ks if k in layout) for ks in keys)
                    missing = tuple(k for ks in keys for k in ks if k not in layout)
                    return FusedStack(name, present, missing)
    return None


def check_fused(fs: FusedStack, shape: Sequence[int], dtype: torch.dtype, layout: Mapping[str, Any],
                dtypes: Mapping[str, torch.dtype]) -> list[str]:
    """What keeps the files' pieces from making the stack ``shape``: absent experts, pieces whose
    shapes do not join into ``[E, rows, cols]``, integer data for a floating stack (none: ``[]``)."""
    if fs.missing:
        shown = ", ".join(repr(k) for k in fs.missing[:4]) + (f" and {len(fs.missing) - 4} more"
                                                               if len(fs.missing) > 4 else "")
        return [f"{fs.name!r} ({list(shape)}) is held per expert in the files, but they lack {shown}"]
    first = [tuple(layout[k].shape) for k in fs.keys[0]]
    rows = sum(s[0] for s in first) if all(len(s) == 2 for s in first) else -1
    if rows != shape[1] or any(s[1] != shape[2] for s in first):
        got = " + ".join(f"{list(s)}" for s in first)
        return [f"{fs.name!r}: the files' per-expert matrices {', '.join(repr(k) for k in fs.keys[0])} ({got}) do "
                f"not join along their rows into the model's {list(shape[1:])} of each of its {shape[0]} experts"]
    problems = []
    for ks in fs.keys[1:]:
        got = [tuple(layout[k].shape) for k in ks]
        if got != first:
            problems.append(f"{ks[0]!r}: {list(got[0])} where expert 0's is {list(first[0])}")
    for k in fs.used:
        src = dtypes[layout[k].dtype]
        if src.is_floating_point != dtype.is_floating_point and src != dtype:
            problems.append(f"{k!r}: {layout[k].dtype} in {layout[k].file.name}, {dtype} in the model (no cast "
                            "between integer and floating point)")
    return problems


def fused_reads(fs: FusedStack, layout: Mapping[str, Any], dst: torch.Tensor,
                part: Optional[tuple[int, int, int]]) -> list[tuple[Any, str, torch.Tensor, Optional[tuple]]]:
    """This rank's reads of the stack: ``(entry, key, destination rows, part of the file tensor)``.

    ``dst`` is what this rank holds of the stack: the whole ``[E, rows, cols]``, or (``part``:
    ``(dim, start, length)`` of the whole stack) an expert-parallel slice or planner block
    (``dim`` 0: only experts ``start..start+length-1`` are read), or a tensor-parallel fragment
    along the rows or the columns (every expert, each file tensor narrowed to the fragment)."""
    dim, start, length = part if part is not None else (None, 0, 0)
    reads = []
    for e, keys in enumerate(fs.keys):
        if dim == 0 and not start <= e < start + length:
            continue  # another rank's expert: not read here
        mine = dst[e - start] if dim == 0 else dst[e]
        row = 0
        for key in keys:
            entry = layout[key]
            rows = entry.shape[0]
            if dim == 1:  # a row fragment: the rows of this piece inside it
                lo, hi = max(row, start), min(row + rows, start + length)
                if hi > lo:
                    reads.append((entry, key, mine.narrow(0, lo - start, hi - lo), (0, lo - row, hi - lo)))
            elif dim == 2:  # a column fragment: every row of the piece, its columns
                reads.append((entry, key, mine.narrow(0, row, rows), (1, start, length)))
            else:  # the piece's rows, read straight into them where dtype and device allow
                reads.append((entry, key, mine.narrow(0, row, rows), None))
            row += rows
    return reads
