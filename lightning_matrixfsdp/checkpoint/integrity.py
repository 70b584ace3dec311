"""Integrity of checkpoint files: sizes and CRC-32 checksums, computed and verified by all ranks.

A directory's sidecar records, for every file the save wrote, its size and the CRC-32
of each 64 MiB chunk (chunks let the ranks and their threads share the work;
``zlib.crc32`` releases the GIL). A load compares sizes always (a ``stat``) and the
checksums unless verification is switched off, before anything is read into the
model, so a truncated or damaged file is named instead of loading silently. A
consolidated file is a ``torch.save`` zip archive, which already carries a CRC-32
per member; it is checked the same way.
"""
from __future__ import annotations

import os
import re
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning_matrixfsdp.checkpoint.agree import agree, all_gather_object, broadcast_object, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointCorruptError

__all__ = ["CHUNK_BYTES", "checksum_threads", "file_records", "verify_files", "verify_zip"]

CHUNK_BYTES = 64 * 2**20
_WRITER = re.compile(r"__(\d+)_")  # DCP's file-name prefix of the rank that wrote a file


def checksum_threads() -> int:
    """Threads each rank uses for checksums: its share of the node's cores (a save or load
    blocks training, so the cores are free), at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(32, cpus // max(1, local)))


def _crc(path: Path, start: int, length: int) -> int:
    crc = 0
    buf = bytearray(min(length, 8 * 2**20) or 1)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left > 0:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise CheckpointCorruptError(f"{path} ends at byte {start + length - left}, expected "
                                             f"{start + length} bytes (truncated)")
            crc = zlib.crc32(view[:n], crc)
            left -= n
    return crc


def _local(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _run(tasks: Sequence[tuple[Any, ...]], fn: Any) -> list[Any]:
    if not tasks:
        return []
    with ThreadPoolExecutor(max_workers=min(checksum_threads(), len(tasks))) as pool:
        return list(pool.map(lambda t: fn(*t), tasks))


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(s, min(CHUNK_BYTES, size - s)) for s in range(0, size, CHUNK_BYTES)] or [(0, 0)]


def file_records(directory: Path, names: Iterable[str], checksums: bool, collective: bool = True
                 ) -> dict[str, dict[str, Any]]:
    """Size (and chunk checksums) of each file; collective unless ``collective=False`` (one process
    does all). The result is valid on rank 0.

    Each DCP data file is checksummed by the rank that wrote it (its pages are likely
    still cached there); other files by rank 0."""
    rank, size = world() if collective else (0, 1)
    run = agree if collective else _local
    names = sorted(names)
    sizes = run(lambda: {n: (directory / n).stat().st_size for n in names} if rank == 0 else None)
    sizes = broadcast_object(sizes) if collective else sizes
    records: dict[str, dict[str, Any]] = {n: {"size": s} for n, s in sizes.items()}
    if not checksums:
        return records
    mine = []
    for n, s in sizes.items():
        m = _WRITER.match(n)
        writer = int(m.group(1)) % size if m else 0
        if writer == rank:
            mine += [(n, i, start, length) for i, (start, length) in enumerate(_chunks(s))]
    crcs = run(_run, mine, lambda n, i, start, length: (n, i, _crc(directory / n, start, length)))
    for part in (all_gather_object(crcs) if collective else [crcs]):
        for n, i, c in part:
            records[n].setdefault("crc32", {})[i] = c
    for n, r in records.items():
        got = r.pop("crc32", {})
        r["crc32"] = [got[i] for i in range(len(got))]
        r["chunk"] = CHUNK_BYTES
    return records


def verify_files(directory: Path, records: Mapping[str, Mapping[str, Any]], checksums: bool,
                 collective: bool = True) -> None:
    """Every recorded file exists with its recorded size and (``checksums``) content. Collective
    unless ``collective=False``: raises :class:`CheckpointCorruptError` naming the files on every rank."""
    run = agree if collective else _local

    def sizes() -> None:
        bad = []
        for n, r in sorted(records.items()):
            f = directory / n
            if not f.is_file():
                bad.append(f"{n} is missing")
            elif f.stat().st_size != r.get("size"):
                bad.append(f"{n} has {f.stat().st_size} bytes, the save wrote {r.get('size')} "
                           "(truncated or replaced)")
        if bad:
            raise CheckpointCorruptError(f"checkpoint {directory} is damaged: " + "; ".join(bad))

    run(sizes)
    if not checksums:
        return
    rank, size = world() if collective else (0, 1)
    tasks = []
    for n, r in sorted(records.items()):
        chunk = r.get("chunk", CHUNK_BYTES)
        for i, c in enumerate(r.get("crc32") or []):
            tasks.append((n, i, i * chunk, min(chunk, r["size"] - i * chunk), c))
    mine = tasks[rank::size]

    def check() -> None:
        got = _run(mine, lambda n, i, start, length, c: (n, start, length, _crc(directory / n, start, length) == c))
        bad = [f"{n} (bytes {start}..{start + length})" for n, start, length, ok in got if not ok]
        if bad:
            raise CheckpointCorruptError(
                f"checkpoint {directory}: checksum mismatch in {', '.join(bad[:10])}: the file was damaged after "
                "the save (disk, copy or transfer error); load an intact copy or an earlier checkpoint")

    run(check)


def verify_zip(path: Path, collective: bool = True) -> Optional[int]:
    """Check the CRC-32 of every member of a ``torch.save`` zip file, split over the ranks.
    Collective unless ``collective=False``; returns the number of members checked (None: not a
    zip file, nothing to check)."""
    rank, size = world() if collective else (0, 1)
    run = agree if collective else _local

    def members() -> Optional[list[tuple[str, int]]]:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as z:
            # CRC 0 on a non-empty member: written with torch's CRC computation switched off
            return sorted(((i.filename, i.file_size) for i in z.infolist() if i.CRC or not i.file_size),
                          key=lambda t: -t[1])

    names = run(members)
    if names is None:
        return None
    mine = [(n,) for n, _ in names[rank::size]]

    def read(name: str) -> Optional[str]:
        try:
            with zipfile.ZipFile(path) as z, z.open(name) as f:
                while f.read(CHUNK_BYTES):
                    pass
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"{name}: {e}"
        return None

    def check() -> None:
        bad = [b for b in _run(mine, read) if b]
        if bad:
            raise CheckpointCorruptError(f"checkpoint {path} is damaged: {'; '.join(bad[:10])}; load an intact "
                                         "copy or an earlier checkpoint")

    run(check)
    return len(names)
