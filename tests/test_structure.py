"""The package's shape: no import cycle, no private name imported across files, short
files, and a code map in docs/how-it-works.md that names every file."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "lightning_matrixfsdp"
MAX_LINES = 600


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import of a package module, at any depth."""
    me, is_pkg = _module(path), path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("lightning_matrixfsdp")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".") if is_pkg else me.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.startswith("lightning_matrixfsdp"):
                names = [a.name for a in node.names]
                out += [(f"{src}.{n}", []) for n in names if f"{src}.{n}" in modules]
                out.append((src, [n for n in names if f"{src}.{n}" not in modules]))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {_module(f) for f in files}
    graph: dict[str, set[str]] = {}
    private = []
    for f in files:
        me = _module(f)
        graph[me] = set()
        for src, names in _imports(f, modules):
            if src in modules and src != me:
                graph[me].add(src)
            private += [f"{me}: from {src} import {n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycle_inside_the_package():
    graph, _ = _graph()
    assert not _cycles(graph), _cycles(graph)


def test_no_private_name_imported_across_files():
    _, private = _graph()
    assert not private, private


def test_files_stay_short():
    long = {str(f.relative_to(ROOT)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_code_map_names_every_library_file():
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text[text.index("## Code map"):]
    skip = {"bench", "demos"}
    missing = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
               if f.parent.name not in skip and f.name != "__init__.py" and f"`{f.name}`" not in section]
    missing += [] if "`__init__.py`" in section else ["runtime/__init__.py"]
    assert not missing, f"docs/how-it-works.md's code map does not name: {missing}"
