"""Host copies of a checkpoint's tensors in buffers allocated once and reused between saves.

An asynchronous save copies what this rank owns to host memory and returns; the files are
written from that copy while training changes the originals. The copy goes into one flat
host buffer, sliced per tensor (64-byte aligned), that is kept for the next save: a save
whose tensors fit in it reuses it (re-slicing it when the layout changed), a larger one
allocates a new one, so host memory stays bounded at one copy of the largest share saved.
Where the source tensors are on a CUDA device the buffer is page-locked once
(``cudaHostRegister``), so the device-to-host copies run at full bandwidth and without a
staging copy of their own; CPU tensors are copied into the same kind of buffer, unpinned
(pinning needs CUDA), on the same code path.

Allocating and pinning a buffer of many GB takes seconds (every page is faulted in), which
would make the first save's stall much longer than the later ones'. ``reserve`` does it in
a background thread ahead of the first save (the strategies call it after the first
optimizer step, once the optimizer state exists); ``stage`` waits for it. A DTensor
(a tensor-parallel fragment that DCP writes as a chunk of the global tensor) is staged as its
local fragment and comes back as the same DTensor over the host copy.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Iterable, Optional

import torch

from lightning_matrixfsdp.runtime.tp.layout import as_dtensor

__all__ = ["HostStaging", "aligned_bytes"]

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


def aligned_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the distinct ``tensors`` take in a staging buffer (a DTensor's local fragment;
    each slice 64-byte aligned)."""
    found: dict[int, torch.Tensor] = {}
    for t in tensors:
        found.setdefault(id(t), t)
    return sum(-(-n * t.element_size() // _ALIGN) * _ALIGN
               for t in found.values() for n in [_local(t).numel()])


class HostStaging:
    """One reusable host buffer for the tensors of a checkpoint state (see the module docstring)."""

    def __init__(self) -> None:
        self._layout: Optional[tuple] = None
        self._flat: Optional[torch.Tensor] = None
        self._cuda = False  # the buffer was made for CUDA sources (pinned, where that succeeded)
        self._pinned = False
        self._views: list[torch.Tensor] = []
        self._reserving: Optional[threading.Thread] = None
        #: how many buffers were allocated so far (reserved or by a save)
        self.allocations = 0

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        """The flat host buffer the copies live in (None before the first ``stage`` or ``reserve``)."""
        self._join()
        return self._flat

    @property
    def nbytes(self) -> int:
        """Host memory the buffer holds."""
        self._join()
        return 0 if self._flat is None else self._flat.numel()

    def reserve(self, nbytes: int, cuda: bool) -> None:
        """Allocate (and, for CUDA sources, pin) a buffer of ``nbytes`` in a background thread,
        unless one at least that large is there; the next ``stage`` waits for it."""
        self._join()
        if self._fits(nbytes, cuda):
            return
        self._reserving = threading.Thread(target=self._allocate, args=(nbytes, cuda, True), daemon=True,
                                           name="mfsdp-host-staging")
        self._reserving.start()

    def _join(self) -> None:
        thread, self._reserving = self._reserving, None
        if thread is not None:
            thread.join()

    def _fits(self, nbytes: int, cuda: bool) -> bool:
        return self._flat is not None and self._cuda == cuda and nbytes <= self._flat.numel()

    def stage(self, state: Any) -> Any:
        """``state`` with every tensor replaced by its host copy (aliases stay aliases). Returns once
        the copies are complete: the originals may change as soon as it returns."""
        found: dict[int, torch.Tensor] = {}
        _tensors(state, found)
        originals = list(found.values())
        sources = [_local(t) for t in originals]
        cuda = any(t.is_cuda for t in sources)
        layout = (cuda, tuple((tuple(t.shape), t.dtype) for t in sources))
        self._join()
        if layout != self._layout:
            total = aligned_bytes(originals)
            if not self._fits(total, cuda):
                self._allocate(total, cuda)
            self._slice(sources)
            self._layout = layout
        for src, dst in zip(sources, self._views):
            dst.copy_(src.detach(), non_blocking=src.is_cuda)
        if cuda:  # the copies ran on each device's current stream, after the step that produced the data
            for dev in {t.device for t in sources if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()
        return _rebuild(state, {id(s): d for s, d in zip(originals, self._views)})

    def _allocate(self, total: int, cuda: bool, touch: bool = False) -> None:
        """A new buffer of ``total`` bytes; pinning faults its pages in, as ``touch`` does unpinned."""
        self._drop()
        flat = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
        pinned = False
        if cuda and total:
            # pinned once for the buffer's life; torch's own pinned allocator would round a
            # buffer of many GB up to the next power of two
            err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
            pinned = int(getattr(err, "value", err)) == 0
        if touch and not pinned:
            flat.zero_()  # the first touch of every page now, not in the first save's copies
        self._flat, self._cuda, self._pinned = flat, cuda, pinned
        self.allocations += 1

    def _slice(self, sources: list[torch.Tensor]) -> None:
        assert self._flat is not None
        offsets, total = [], 0
        for t in sources:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self._views = [self._flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                       for o, t in zip(offsets, sources)]

    def _drop(self) -> None:
        if self._flat is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
        self._flat, self._views, self._pinned, self._layout = None, [], False, None

    def release(self) -> None:
        """Give the buffer back (a later ``stage`` allocates a new one)."""
        self._join()
        self._drop()
