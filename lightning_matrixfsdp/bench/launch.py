"""Process launch: torchrun, self-spawned CPU workers, or a single process.

Under torchrun the usual RANK/WORLD_SIZE/LOCAL_RANK variables are read. With
`--nproc N` (and no torchrun variables) N workers are spawned on this machine
with a free loopback port, for convenience on CPU. The benchmark also keeps a
gloo "control" group for its own bookkeeping (timings, errors), so a broken
mode group never takes the reporting down with it.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_device(name: str) -> torch.device:
    """auto -> cuda:LOCAL_RANK when CUDA exists, else cpu."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Default group: NCCL on CUDA, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device
    if not launched_by_torchrun():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        kwargs.update(rank=0, world_size=1)
    dist.init_process_group(**kwargs)


def control_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over all ranks for the benchmark's own CPU-side messages."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _spawn_entry(local_rank: int, world: int, port: int, threads: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads)
    fn(*args)


def spawn(nproc: int, fn: Callable[..., None], args: tuple = ()) -> None:
    """Run `fn(*args)` in `nproc` fresh processes that look torchrun-launched."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    mp.start_processes(_spawn_entry, args=(nproc, free_port(), threads, fn, args), nprocs=nproc, join=True, start_method="spawn")
