"""Run a function on N CPU processes over gloo and collect each rank's result.

Failures come back as the worker's traceback; a worker that hangs is killed after
``timeout`` seconds so a broken collective fails the test instead of the suite.
"""
from __future__ import annotations

import itertools
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world:
        try:
            rank, status, payload = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except _q.Empty:
            break
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            break  # peers of a failed rank may be stuck in a collective
    for p in procs:
        p.join(timeout=5 if not errors else 1)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    if len(results) < world:
        raise AssertionError(f"distributed run timed out after {timeout}s ({len(results)}/{world} ranks finished)")
    return [results[r] for r in range(world)]


class _KeptRun:
    """A run shared by the tests of a file, made by the first that asks. A failure is kept too,
    so the tests after it raise it again instead of running it again."""

    def __init__(self) -> None:
        self._done: tuple[Any, Any] | None = None

    def _once(self, run: Callable[[], list[Any]]) -> list[Any]:
        if self._done is None:
            try:
                self._done = (run(), None)
            except AssertionError as e:
                self._done = (None, e)
        res, err = self._done
        if err is not None:
            raise err
        return res


class OneLaunch(_KeptRun):
    """One ``run_distributed`` shared by the tests of a file (its own processes)."""

    def __init__(self, fn: Callable, world: int, *args: Any, timeout: float = 240.0) -> None:
        super().__init__()
        self.fn, self.world, self.args, self.timeout = fn, world, args, timeout

    def results(self) -> list[Any]:
        return self._once(lambda: run_distributed(self.fn, self.world, *self.args, timeout=self.timeout))


class PoolTask(_KeptRun):
    """``OneLaunch`` on a warm pool: one ``DistPool.run`` shared by the tests of a file, so the file
    pays no process start-up of its own. The pool comes from its fixture (``dist_pools(world)`` or
    ``hf_pool``): passed to ``results``, or set once as ``pool`` by an autouse fixture of the file."""

    def __init__(self, fn: Callable, *args: Any, timeout: float = 240.0) -> None:
        super().__init__()
        self.fn, self.args, self.timeout = fn, args, timeout
        self.pool: "DistPool | None" = None

    def results(self, pool: "DistPool | None" = None) -> list[Any]:
        pool = pool or self.pool
        assert pool is not None, "PoolTask.results needs a pool (its fixture's), passed or set as .pool"
        return self._once(lambda: pool.run(self.fn, *self.args, timeout=self.timeout))


def run_checked(pool: "DistPool", fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``pool.run(fn, *args)`` for scenarios that return ``{"error": traceback}`` on failure: every
    rank's error shown (the first rank's first), else each rank's result."""
    res = pool.run(fn, *args, timeout=timeout)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def _pool_worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        environ = dict(os.environ)
        for task_no in itertools.count(1):
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            # Each task starts from the defaults: a task that set float64 (tests/helpers/equiv.py does for
            # some runs), an environment variable or another thread count must not hand it to the
            # next test that happens to run in this process.
            torch.set_default_dtype(torch.float32)
            torch.set_num_threads(1)
            torch.set_grad_enabled(True)
            os.environ.clear()
            os.environ.update(environ)
            try:
                result = fn(rank, world, *args)
            except BaseException:  # noqa: BLE001
                results.put((rank, "error", traceback.format_exc()))
                continue
            # Every rank must leave the task at the same point of the group's collective stream,
            # or the next test would start out of step: check it here so this task fails instead.
            count = torch.tensor([task_no])
            dist.all_reduce(count)
            if count.item() != task_no * world:
                results.put((rank, "error", f"ranks left task {task_no} out of step (sum {count.item()})"))
                continue
            results.put((rank, "ok", result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistPool:
    """``world`` gloo workers kept alive across tests: the process start-up (importing
    torch) is paid once per pool instead of once per test.  A failed or timed-out task
    tears the pool down (its process group may be wedged); the next task restarts it.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, self.world, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 240.0) -> list[Any]:
        import queue as _q
        import time

        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for t in self.tasks:
            t.put((fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            try:
                rank, status, payload = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except _q.Empty:
                self.close()
                raise AssertionError(f"distributed task timed out after {timeout}s "
                                     f"({len(results)}/{self.world} ranks finished)") from None
            if status != "ok":
                self.close()
                raise AssertionError(f"distributed worker failed:\n--- rank {rank} ---\n{payload}")
            results[rank] = payload
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for t in getattr(self, "tasks", []):
            try:
                t.put(None)
            except Exception:  # noqa: BLE001
                pass
        import time

        deadline = time.monotonic() + 2  # the workers leave together: one wait for all of them
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        self.procs = []


STRATEGIES = ("ddp", "matrix_fsdp")


def under_both(cache: dict, name: str, run_one: Callable[[str], list[Any]]) -> tuple[list, list]:
    """``run_one(strategy)`` for DDP and for matrix_fsdp, once per ``name`` (kept in ``cache``);
    a scenario that came back as ``{"error": text}`` on any rank fails the calling test with it."""
    if name not in cache:
        cache[name] = tuple(run_one(strategy) for strategy in STRATEGIES)
    for strategy, res in zip(STRATEGIES, cache[name]):
        for r in res:
            assert "error" not in r, f"{name} under {strategy}:\n{r['error']}"
    return cache[name]
