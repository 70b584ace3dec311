"""The helper thread behind interruptible gloo waits is gone before the interpreter exits.

Left blocked (holding the last gloo work it waited for) while Python and the C++ runtime
were torn down under it, processes that had waited through it aborted now and then at exit
("terminate called without an active exception", exit status -6) after a clean run:
7 of 40 four-run loops of scripts/cpu_convnet.py before the fix, 0 of 20 after. (Gloo can
abort in teardown without us too: a plain DDP run did once.) The check here is
deterministic: an exit handler registered before the library is imported runs after the
library's own and reports whether the thread is alive.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, os, threading
    atexit.register(lambda: print("waiter alive at exit:",
                                  any(t.name == "matrix-fsdp-wait" for t in threading.enumerate()), flush=True))
    import torch, torch.distributed as dist
    from lightning_matrixfsdp.runtime.comm.waits import wait_works
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(4)
    wait_works([dist.all_reduce(t, async_op=True)], "a test all-reduce")
    print("waiter started:", any(t.name == "matrix-fsdp-wait" for t in threading.enumerate()), flush=True)
    # what a test suite does to a daemon thread a test left behind (test 2), then a new wait
    waiter = next(t for t in threading.enumerate() if t.name == "matrix-fsdp-wait")
    stop = getattr(waiter, "stop", None)
    print("waiter daemon with stop():", waiter.daemon and callable(stop), flush=True)
    if callable(stop):
        stop()
    print("stopped waiter gone:", not waiter.is_alive(), flush=True)
    wait_works([dist.all_reduce(t, async_op=True)], "another all-reduce")  # a new one starts
    print("waiter restarted:", any(t.name == "matrix-fsdp-wait" for t in threading.enumerate()), flush=True)
    dist.destroy_process_group()
""")


@functools.lru_cache(maxsize=1)
def _script_output() -> tuple[int, str, str]:
    """One run of SCRIPT (a fresh interpreter: its exit is what test 1 checks), read by both tests."""
    from helpers.dist import _free_port

    env = {**os.environ, "PORT": str(_free_port())}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    return out.returncode, out.stdout, out.stderr


def test_the_wait_thread_is_stopped_at_exit():
    """The waiter alive at exit is the one started after test 2's stop(): the library's exit
    handler stops whichever waiter is current."""
    rc, stdout, stderr = _script_output()
    assert rc == 0, stderr[-2000:]
    assert "waiter started: True" in stdout, stdout
    assert "waiter restarted: True" in stdout, stdout
    assert "waiter alive at exit: False" in stdout, stdout


def test_the_wait_thread_stops_as_test_suites_stop_leftover_threads():
    """Lightning's test suite calls ``stop()`` on a daemon thread a test left behind, then
    requires it to be gone; without the method the test fails ("Test left zombie thread").
    A new wait afterwards starts a new thread. (Run in test 1's interpreter: one start-up.)"""
    rc, stdout, stderr = _script_output()
    assert "waiter daemon with stop(): True" in stdout, (stdout, stderr[-2000:])
    assert "stopped waiter gone: True" in stdout, stdout
    assert "waiter restarted: True" in stdout, stdout
    assert rc == 0, stderr[-2000:]
