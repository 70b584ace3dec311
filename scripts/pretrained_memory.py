"""Peak host memory per rank and load time: ``from_pretrained`` + sharding vs ``load_pretrained``.

A Llama built from a config (about 1.1B parameters by default) is saved with
``save_pretrained`` into ``--dir`` (outside the repository), then each way runs in its own
pair of fresh gloo processes on the CPU, so that each process's RSS high-water mark
(``VmHWM``) is that way's alone:

* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dir)`` on every rank, then ``matrix_shard``;
* ``load_pretrained``: ``meta_init()`` + ``from_config``, ``matrix_shard``, ``load_pretrained(dir)``.

Both end with the same sharded model (checked: a digest of each rank's owned tensors).
Writes a small JSON (``--out``)::

    python scripts/pretrained_memory.py --dir /tmp/llama-1b --out docs/results/<date>-cpu-<rev>-pretrained.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _rss_mib() -> float:
    """This process's peak resident set size, MiB: ``VmHWM`` of this address space. ``ru_maxrss``
    is not used alone: Linux carries it over ``exec``, so a spawned worker would report its
    parent's peak (the parent built and saved the model)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank: int, world: int, port: int, way: str, path: str, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import is_owned

    before = _rss_mib()
    dist.barrier()
    t0 = time.perf_counter()
    if way == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(path)
        mf.matrix_shard(model, wrap_policy=LAYER)
    else:
        with mf.meta_init():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        mf.matrix_shard(model, wrap_policy=LAYER)
        mf.load_pretrained(model, path)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = _rss_mib()  # before the digest below, whose float64 copies are not part of loading
    owned = {n: p for n, p in model.named_parameters() if is_owned(p)}
    digest = sum(float(p.detach().sum(dtype=torch.float64)) for p in owned.values())  # same model both ways
    queue.put((rank, {"seconds": round(seconds, 2), "peak_rss_mib": round(peak, 1),
                      "rss_before_load_mib": round(before, 1), "owned_params": sum(p.numel() for p in owned.values()),
                      "digest": digest}))
    dist.destroy_process_group()


def run_way(way: str, path: str, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, way, path, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="where the model is saved (outside the repository)")
    ap.add_argument("--out", required=True, help="the JSON written")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                         use_cache=False)
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        model = LlamaForCausalLM(config)
        model.save_pretrained(path)
        del model
    from lightning_matrixfsdp.checkpoint.pretrained import safetensors_layout

    layout = safetensors_layout(path)
    n_params = sum(int(torch.Size(e.shape).numel()) for e in layout.values())
    file_bytes = sum(e.end - e.begin for e in layout.values())
    ways = {w: run_way(w, str(path), args.world) for w in ("from_pretrained", "load_pretrained")}
    assert [r["digest"] for r in ways["from_pretrained"]] == [r["digest"] for r in ways["load_pretrained"]], ways
    ratio = max(r["peak_rss_mib"] for r in ways["load_pretrained"]) / max(r["peak_rss_mib"]
                                                                         for r in ways["from_pretrained"])
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "git_revision": rev, "torch": torch.__version__,
              "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join([Path(sys.executable).name] + sys.argv), "world": args.world,
              "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                        "vocab": args.vocab, "params": n_params, "dtype": "float32", "file_bytes": file_bytes},
              "ways": ways, "peak_ratio_load_pretrained_over_from_pretrained": round(ratio, 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, separators=(",", ":")) + "\n")  # compact, as docs/results keeps JSON
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
