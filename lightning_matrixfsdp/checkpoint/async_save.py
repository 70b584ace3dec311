"""Asynchronous directory saves: training stalls for the copy to host memory only.

``AsyncCheckpointer.save`` runs every collective step of a save on the calling (main)
thread, on the default group, as the synchronous save does: it waits for the previous
save, agrees on the path and the options, splits the views, creates the partial
directory, then copies what this rank owns into reused host buffers (``staging.py``)
and serializes ``meta.pt``; then it returns. A background thread writes this rank's
files (DCP), checksums them, writes the sidecar and publishes by rename, as
``save.finish_dir`` does for a synchronous save. Its agreements (DCP's plan, every
rank's completion before the publish) run on a gloo group of all ranks made once, on the
main thread, at the first save, and used by nothing else: no collective of the training
ever interleaves with them.

Ordering: a save waits for the previous one; ``after_publish`` defers what must see a
completed checkpoint (Lightning's top-k deletion, the ``save_last`` link) until the
pending save is published (and drops it when the save failed: nothing older is deleted
for a checkpoint that does not exist); ``wait`` completes everything. A failure of the
background work is kept and raised by the next ``wait`` (the next save, the end of
``fit``, a load), on every rank, naming the path and the cause; an agreed failure removes
the partial as a synchronous save does, and a crash leaves only a hidden partial that the
next save of that target removes.

Other readers: every save in the background is listed in ``pending.py`` while it runs (and,
when it failed, until its failure is raised here), so a read of its path in this process
waits for it, whatever object reads. At interpreter exit a pending save completes before
Python stops accepting work for thread pools (the checksums use one): a failure nobody
raised yet is printed to stderr; a save is never left half-written by the exit itself.
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - imported before our exit hook is registered (see the end)
import io
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

import lightning_matrixfsdp.checkpoint.pending as pending_saves
from lightning_matrixfsdp.checkpoint.agree import agree, agreed_path, on_group, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointError
from lightning_matrixfsdp.checkpoint.formats import optimizer_class, unwrap_optimizer
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.save import DirSave, PathLike, finish_dir, prepare_dir, remove_entry
from lightning_matrixfsdp.checkpoint.staging import HostStaging, aligned_bytes
from lightning_matrixfsdp.checkpoint.state_dict import sharded_model_state_dict, sharded_optimizer_state_dict
from lightning_matrixfsdp.runtime.comm.small import gloo_subgroups
from lightning_matrixfsdp.runtime.views.checkpoint import stage_roots

__all__ = ["AsyncCheckpointer"]

_LIVE: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()


def _background_group() -> Any:
    """A gloo group of every rank (None without a process group). Collective: main thread, all ranks."""
    import torch.distributed as dist  # queries only; the group is made by small_comm

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return gloo_subgroups([list(range(dist.get_world_size()))])


class AsyncCheckpointer:
    """Saves checkpoint directories in the background (see the module docstring). One per run."""

    def __init__(self) -> None:
        self.staging = HostStaging()
        self._group: Any = None
        self._group_made = False
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._after: list[Callable[[], None]] = []
        self._accepting = False  # the background thread will still run what after_publish queues
        self._lock = threading.Lock()
        self._listed: Optional[int] = None  # this save's token in ``pending``
        self._reserved = False
        _LIVE.add(self)

    @property
    def pending(self) -> bool:
        """Whether a save is being written in the background."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ main thread
    def reserve(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Allocate (and pin) the host buffer for this rank's share of a save in the background,
        once, so the first save stalls no longer than the later ones: call it when the optimizer
        state exists (after the first step). The share: this rank's parameters (owned ones are
        whole, the others empty), buffers and optimizer state; under pipeline parallelism those of
        this rank's stages only (the other stages' buffers stay in ``module`` but are not saved here).
        Local, no collective."""
        if self._reserved:
            return
        self._reserved = True
        sources = stage_roots(module) or [module]
        params = {id(p): p for m in sources for p in m.parameters()}  # tied ones once
        tensors = [p.detach() for p in params.values()] + [b for m in sources for b in m.buffers()]
        for opt in optimizers:
            for state in unwrap_optimizer(opt).state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        cuda = any(t.is_cuda for t in tensors)
        self.staging.reserve(aligned_bytes(tensors), cuda)

    def save_sharded(self, module: nn.Module, path: PathLike, optimizers: Iterable[torch.optim.Optimizer] = (),
                     extra: Optional[Mapping[str, Any]] = None, *, checksums: bool = True) -> None:
        """``checkpoint.save_sharded`` (directory format), returning once the state is in host memory."""
        optimizers = [unwrap_optimizer(o) for o in optimizers]
        self.wait()
        index = build_index(module)
        checkpoint = dict(extra or {})
        checkpoint["state_dict"] = sharded_model_state_dict(module, False, index)
        checkpoint["optimizer_states"] = [sharded_optimizer_state_dict(module, o, False, index) for o in optimizers]
        self.save(module, checkpoint, path, [optimizer_class(o) for o in optimizers], index=index,
                  checksums=checksums)

    def save(self, module: nn.Module, checkpoint: Mapping[str, Any], path: PathLike,
             optimizer_classes: Sequence[str] = (), *, index: Optional[KeyIndex] = None,
             checksums: bool = True) -> None:
        """``write_checkpoint`` (directory format) of the state dicts in ``checkpoint``; returns once
        this rank's share is copied to host memory. Collective: call it on every rank."""
        self.wait()  # the previous save is published (or its failure raised) before this one starts
        path = agreed_path(path, full=False, checksums=bool(checksums),
                           optimizers=len(checkpoint.get("optimizer_states") or []), asynchronous=True)
        index = index if index is not None else build_index(module)
        if not self._group_made:
            self._group, self._group_made = _background_group(), True
        job = prepare_dir(dict(checkpoint), path, index, optimizer_classes, checksums)
        try:
            agree(self._stage, job)
        except BaseException:
            if world()[0] == 0:
                remove_entry(job.tmp)
            raise
        thread = threading.Thread(target=self._write, args=(job,), name=f"mfsdp-async-save:{path.name}")
        self._thread, self._accepting = thread, True
        self._listed = pending_saves.add(path, self._wait_quietly)
        thread.start()

    def _stage(self, job: DirSave) -> None:
        job.state = self.staging.stage(job.state)
        buf = io.BytesIO()
        torch.save(job.meta, buf)  # loops, schedulers, callbacks: small, and as they are now
        job.meta = buf.getvalue()

    def after_publish(self, fn: Optional[Callable[[], None]]) -> None:
        """Run ``fn`` (on this rank, if given) once the pending save is published, right away if
        none is pending; dropped if the pending save fails."""
        with self._lock:
            if fn is None or self._error is not None:  # the save failed: keep what it would replace
                return
            if self._accepting:
                self._after.append(fn)
                return
        fn()

    def _wait_quietly(self) -> Optional[BaseException]:
        """For another reader of the path (``pending.wait_for``): wait, return the failure, keep it."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        return self._error

    def wait(self, collective: bool = True) -> None:
        """Complete the pending save and run what waited for it; raise its failure. ``collective``
        (every rank calls it, main thread): the ranks agree, so all raise alike."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        err, self._error = self._error, None
        if self._listed is not None:
            pending_saves.remove(self._listed)
            self._listed = None
        if not collective or world()[1] == 1:
            if err is not None:
                raise err
            return

        def _report() -> None:
            if err is not None:
                raise err
        try:
            agree(_report)
        except Exception:
            if err is not None:  # the collective itself failed (a peer died): this rank's own cause
                raise err from None
            raise

    def close(self) -> None:
        """Complete the pending save (no collective) and give the host buffer back; raises its failure."""
        try:
            self.wait(collective=False)
        finally:
            self.staging.release()

    # ------------------------------------------------------------------ background thread
    def _write(self, job: DirSave) -> None:
        try:
            with on_group(self._group):
                finish_dir(job)
        except BaseException as e:  # noqa: BLE001 - kept and raised on the main thread
            with self._lock:
                self._after.clear()
                self._accepting = False
                self._error = _named(e, job.path)
            return  # stays listed in ``pending`` until ``wait`` raises the failure: readers see it too
        while True:
            with self._lock:
                if not self._after:
                    self._accepting = False
                    break
                fn = self._after.pop(0)
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                self._error = CheckpointError(f"after publishing checkpoint {job.path}: {type(e).__name__}: {e}")
        if self._error is None and self._listed is not None:
            pending_saves.remove(self._listed)


def _named(e: BaseException, path: Path) -> CheckpointError:
    """The background failure as a ``CheckpointError`` naming the path and the cause."""
    msg = str(e)
    if isinstance(e, CheckpointError) and str(path) in msg:
        err = type(e)(f"asynchronous save: {msg}")
    else:
        err = CheckpointError(f"asynchronous save of checkpoint {path} failed: {type(e).__name__}: {msg}; the "
                              "previous checkpoint at that path is unchanged")
    err.__cause__ = e
    return err


def _complete_at_exit() -> None:
    """The process exits only with its saves complete; a failure nobody saw is printed."""
    for saver in list(_LIVE):
        try:
            saver.close()
        except BaseException as e:  # noqa: BLE001 - at exit there is no caller left to raise to
            print(f"lightning_matrixfsdp: {e}", file=sys.stderr)


# Python's exit first stops thread pools from taking work (``concurrent.futures`` registers that
# with ``threading._register_atexit`` when it is imported, above), then joins the remaining
# threads, then runs ``atexit``: a save still running would fail in its checksum pool. Registered
# the same way after that import, this runs first (these hooks run last-in first-out).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_complete_at_exit)
else:  # an interpreter without it: at least the atexit stage
    atexit.register(_complete_at_exit)
