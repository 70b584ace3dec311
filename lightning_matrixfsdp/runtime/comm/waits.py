"""Waiting for communication that blocks the host, so that SIGINT and SIGTERM still end it.

On gloo (CPU) a wait blocks inside C++, where Python runs no signal handler: a rank
whose peer is stuck or gone would ignore Ctrl-C and SIGTERM (under Lightning, whose
SIGTERM handler is Python) until the process-group timeout.  :func:`wait_works` hands
the blocking wait to a helper thread and waits on an event, which signals interrupt.
A signal that arrives while waiting is held back for a short grace period: if the
communication finishes, the previous handler gets the signal as usual (Lightning's
graceful SIGTERM, ``KeyboardInterrupt``); if not, :class:`CollectiveInterrupted` is
raised and the process leaves at exit without waiting for the collective (the
process group's destructor would wait for it forever).

NCCL waits do not block the host (they order streams) and never come here.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

from lightning_matrixfsdp.runtime.errors import CollectiveInterrupted

GRACE_S = 1.0  # how long a signalled wait may still finish before it is abandoned
_SLICE_S = 0.05  # the main thread wakes this often to notice a signal
_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_Job = tuple[Sequence[Any], threading.Event, list]


class _Waiter(threading.Thread):
    """One daemon thread per process that blocks in ``work.wait()`` for the main thread."""

    def __init__(self) -> None:
        super().__init__(name="matrix-fsdp-wait", daemon=True)
        self.jobs: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread once its current job is done. The name is the convention that test
        suites' thread checks call on a daemon thread left over from a test (Lightning's does)."""
        if self.is_alive():
            self.jobs.put(None)  # type: ignore[arg-type]
            self.join(timeout=timeout)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # stop(): the run or the interpreter is ending
                return
            works, done, errors = job
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                errors.append(e)
            done.set()


_waiter: Optional[_Waiter] = None
_waiter_lock = threading.Lock()
_leaving: list[int] = []


def _the_waiter() -> _Waiter:
    global _waiter
    with _waiter_lock:
        if _waiter is None or not _waiter.is_alive():  # threads do not survive fork
            _waiter = _Waiter()
            _waiter.start()
            if not _stop_registered:
                _stop_registered.append(True)
                atexit.register(stop_waiter)
        return _waiter


_stop_registered: list[bool] = []


def stop_waiter() -> None:
    """End the helper thread; the next wait starts a new one.

    Called at interpreter exit, so the thread is not left blocked (holding the last gloo
    work it waited for) while the interpreter and the C++ runtime are torn down under it
    (one way a gloo process aborted at exit after a clean run), and by the strategies'
    ``teardown`` so that no thread of ours outlives ``fit``. A rank that abandoned a wait
    (``CollectiveInterrupted``) leaves the thread alone: it is blocked for good.
    """
    waiter = _waiter
    if waiter is not None and not _leaving:
        waiter.stop()


def wait_works(works: Sequence[Any], what: str) -> None:
    """``work.wait()`` for each of ``works``; SIGINT/SIGTERM end a wait that does not finish."""
    works = [w for w in works if w is not None]
    if not works:
        return
    if threading.current_thread() is not threading.main_thread():
        for w in works:  # signal handlers run in the main thread only
            w.wait()
        return
    done, errors = threading.Event(), []
    _the_waiter().jobs.put((works, done, errors))
    received: list[int] = []
    previous: dict[int, Any] = {}
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not signal.SIG_IGN and handler is not None:
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        deadline: Optional[float] = None
        while not done.wait(_SLICE_S):
            if received and deadline is None:
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                name = signal.Signals(received[0]).name
                _leave_at_exit(received[0])
                raise CollectiveInterrupted(
                    f"{name} while this rank waited for {what}, which did not finish within {GRACE_S:g} s "
                    "(a peer rank is stuck or gone); stopping, without waiting for the collective")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if errors:
        raise errors[0]
    for sig in received:  # the wait finished: the signal goes where it was meant to go
        _redeliver(sig, previous[sig])


def _redeliver(sig: int, handler: Any) -> None:
    if callable(handler):
        handler(sig, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), sig)


def _leave_at_exit(sig: int) -> None:
    """At interpreter exit, leave with the signal's status before the process group's
    destructor waits for the abandoned collective."""
    if _leaving:
        return
    _leaving.append(sig)

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(128 + sig)

    atexit.register(leave)
