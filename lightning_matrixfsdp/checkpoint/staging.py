"""Host copies of a checkpoint's tensors in buffers allocated once and reused between saves.

An asynchronous save copies what this rank owns to host memory and returns; the files are
written from that copy while training changes the originals. The copy goes into one flat
host buffer, sliced per tensor (64-byte aligned), that is kept for the next save and
re-allocated only when the tensors' layout (shapes, dtypes, order) changes, so host memory
stays bounded at one copy of this rank's share. Where the source tensors are on a CUDA
device the buffer is page-locked once (``cudaHostRegister``), so the device-to-host copies
run at full bandwidth and without a staging copy of their own; CPU tensors are copied into
the same kind of buffer, unpinned (pinning needs CUDA), on the same code path. A DTensor
(a tensor-parallel fragment that DCP writes as a chunk of the global tensor) is staged as its
local fragment and comes back as the same DTensor over the host copy.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from lightning_matrixfsdp.runtime.tp import as_dtensor

__all__ = ["HostStaging"]

_ALIGN = 64


def _tensors(obj: Any, out: dict[int, torch.Tensor]) -> None:
    """The distinct tensors of a nest of dicts, lists and tuples, in traversal order."""
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    """What is copied of ``t``: a DTensor's local fragment (its global shape is not held here)."""
    return t.to_local() if _is_dtensor(t) else t


def _rebuild(obj: Any, copies: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        c = copies[id(obj)]
        if _is_dtensor(obj):  # a DTensor: the same placement over the host copy
            return as_dtensor(c, (obj.device_mesh, tuple(obj.placements), obj.shape, obj.stride()))
        return c
    if isinstance(obj, dict):
        return {k: _rebuild(v, copies) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, copies) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, copies) for v in obj)
    return copy.deepcopy(obj)  # small leaves (hyper-parameters); never shared with training


class HostStaging:
    """One reusable host buffer for the tensors of a checkpoint state (see the module docstring)."""

    def __init__(self) -> None:
        self._layout: Optional[tuple] = None
        self._flat: Optional[torch.Tensor] = None
        self._pinned = False
        self._views: list[torch.Tensor] = []

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        """The flat host buffer the copies live in (None before the first ``stage``)."""
        return self._flat

    @property
    def nbytes(self) -> int:
        """Host memory the buffer holds."""
        return 0 if self._flat is None else self._flat.numel()

    def stage(self, state: Any) -> Any:
        """``state`` with every tensor replaced by its host copy (aliases stay aliases). Returns once
        the copies are complete: the originals may change as soon as it returns."""
        found: dict[int, torch.Tensor] = {}
        _tensors(state, found)
        originals = list(found.values())
        sources = [_local(t) for t in originals]
        cuda = any(t.is_cuda for t in sources)
        layout = (cuda, tuple((tuple(t.shape), t.dtype) for t in sources))
        if layout != self._layout:
            self._allocate(sources, cuda)
            self._layout = layout
        for src, dst in zip(sources, self._views):
            dst.copy_(src.detach(), non_blocking=src.is_cuda)
        if cuda:  # the copies ran on each device's current stream, after the step that produced the data
            for dev in {t.device for t in sources if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()
        return _rebuild(state, {id(s): d for s, d in zip(originals, self._views)})

    def _allocate(self, sources: list[torch.Tensor], cuda: bool) -> None:
        self.release()
        offsets, total = [], 0
        for t in sources:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        flat = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
        if cuda and total:
            # pinned once for the buffer's life; torch's own pinned allocator would round a
            # buffer of many GB up to the next power of two
            err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
            self._pinned = int(getattr(err, "value", err)) == 0
        self._flat = flat
        self._views = [flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                       for o, t in zip(offsets, sources)]

    def release(self) -> None:
        """Give the buffer back (a later ``stage`` allocates a new one)."""
        if self._flat is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
        self._flat, self._views, self._pinned, self._layout = None, [], False, None
