"""Run several example commands in one 2-rank job: the process start-up (torch, Lightning,
transformers imported on every rank) is paid once instead of once per command.

    python tests/helpers/run_examples.py script examples/finetune_hf.py --max-steps 4 ::: cli fit --config ...

Each part is what a user runs: ``script PATH ARGS`` calls the example file's ``main(ARGS)`` (what its
``__main__`` block calls), ``cli ARGS`` calls ``lightning_matrixfsdp.cli.main(ARGS)`` (what the
``lightning-matrixfsdp`` console script calls). Lightning's launcher re-runs this file with the same
arguments for rank 1, and the later parts find the ranks already launched (``LOCAL_RANK`` set), so
every part runs on the same two processes. Rank 0 prints ``PART_LINE`` before each part; ``parts``
splits the output there.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SEPARATOR = ":::"
PART_LINE = "[run-examples] part "


def command(*parts: list[str]) -> list[str]:
    """The command line that runs ``parts`` (each ``["script", path, ...]`` or ``["cli", ...]``) in one job."""
    out = [sys.executable, str(Path(__file__).resolve())]
    for i, part in enumerate(parts):
        out += ([SEPARATOR] if i else []) + [str(a) for a in part]
    return out


def parts(stdout: str, count: int) -> list[str]:
    """The output of each part, in order (rank 0's marker lines split it)."""
    pieces = stdout.split(PART_LINE)
    assert len(pieces) == count + 1, f"expected {count} parts, got {len(pieces) - 1}:\n{stdout[-3000:]}"
    return [p.split("\n", 1)[1] if "\n" in p else "" for p in pieces[1:]]


def _run(no: int, part: list[str]) -> None:
    kind, args = part[0], part[1:]
    if kind == "script":
        spec = importlib.util.spec_from_file_location(f"example_part_{no}", args[0])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(args[1:])
    elif kind == "cli":
        from lightning_matrixfsdp.cli import main

        main(args)
    else:
        raise SystemExit(f"unknown part kind {kind!r} (script or cli)")


def main(argv: list[str]) -> None:
    groups: list[list[str]] = [[]]
    for a in argv:
        if a == SEPARATOR:
            groups.append([])
        else:
            groups[-1].append(a)
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"  # unset on rank 0 before the first launch
    for no, part in enumerate(groups):
        if rank0:
            print(f"{PART_LINE}{no}", flush=True)
        _run(no, part)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
