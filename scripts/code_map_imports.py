"""Rewrite the import column of the code map (end of docs/how-it-works.md) from the real imports.

    python scripts/code_map_imports.py          # rewrite in place, print the rows changed
    python scripts/code_map_imports.py --check  # exit 1 if a row would change

The rules are `tests/test_structure.py`'s (the test that checks the column): a name is a
module of the table's package (``agree``), else of the whole package (``runtime.tags``).
Names that stay keep their order; new ones follow, sorted.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_structure import PKG, _module, _package_imports  # noqa: E402


def short(package: str, module: str) -> str:
    if module.startswith(package + ".") and package != "lightning_matrixfsdp":
        return module[len(package) + 1:]
    return module.split(".", 1)[1] if "." in module else module


def main(check: bool) -> int:
    doc = ROOT / "docs" / "how-it-works.md"
    text = doc.read_text()
    start = text.index("## Code map")
    head, lines = text[:start], text[start:].splitlines(keepends=True)
    modules = {_module(f) for f in PKG.rglob("*.py")}
    package, changed = "lightning_matrixfsdp", []
    for i, line in enumerate(lines):
        if line.startswith("**"):
            folder = re.search(r"`([\w/]+)/`", line)
            package = "lightning_matrixfsdp" + (f".{folder.group(1).replace('/', '.')}" if folder else "")
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.rstrip("\n").strip().strip("|").split(" | ")]
            files = re.findall(r"`([\w.]+\.py)`", cells[0])
            real: set[str] = set()
            for name in files:
                path = ROOT / Path(*package.split(".")) / name
                if path.is_file():
                    real |= _package_imports(path, modules)
            names = [short(package, m) for m in real]
            old = re.findall(r"`([\w.]+)`", cells[-1])
            ordered = [n for n in old if n in names] + sorted(n for n in names if n not in old)
            cells[-1] = ", ".join(f"`{n}`" for n in ordered) if ordered else "—"
            new = "| " + " | ".join(cells) + " |\n"
            if new != line:
                changed.append(f"{package}: {', '.join(files)}: {old} -> {ordered}")
                lines[i] = new
    print("\n".join(changed) or "code map import column up to date")
    if check:
        return 1 if changed else 0
    doc.write_text(head + "".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
