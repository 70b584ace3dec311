"""The package's shape: no import cycle, no private name imported across files, short
files, and a code map in docs/how-it-works.md that names every file."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "lightning_matrixfsdp"
MAX_LINES = 450


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
    assert not long, f"over {MAX_LINES} lines: " + ", ".join(f"{f} ({n})" for f, n in sorted(long.items()))


def test_code_map_names_every_library_file():
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text[text.index("## Code map"):]
    skip = {"bench", "demos"}
    missing = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
               if not skip & set(f.relative_to(PKG).parts) and f.name != "__init__.py" and f"`{f.name}`" not in section]
    missing += [] if "`__init__.py`" in section else ["runtime/__init__.py"]
    assert not missing, f"docs/how-it-works.md's code map does not name: {missing}"


# ---------------------------------------------------------------- the code map's import column
def _package_imports(path: Path, modules: set[str]) -> set[str]:
    """Every package module ``path`` imports (at any depth), itself excepted: ``from pkg import
    mod`` counts the module, ``from pkg import name`` the package."""
    me, is_pkg = _module(path), path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".") if is_pkg else me.split(".")[:-1]
                src = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                out.add(f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src)
    return {m for m in out if m in modules and m != me}


def _code_map_rows() -> list[tuple[str, list[str], list[str]]]:
    """(package of the table, files of the row, names in its import column) for every row of
    the code map's tables; a table's package is the first backticked ``folder/`` (or
    ``folder/sub/``) of the bold line above it (none: the top level)."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text[text.index("## Code map"):]
    rows, package = [], "lightning_matrixfsdp"
    for line in section.splitlines():
        if line.startswith("**"):
            folder = re.search(r"`([\w/]+)/`", line)
            package = "lightning_matrixfsdp" + (f".{folder.group(1).replace('/', '.')}" if folder else "")
        elif line.startswith("| `"):
            cells = line.strip().strip("|").split(" | ")
            files = re.findall(r"`([\w.]+\.py)`", cells[0])
            rows.append((package, files, re.findall(r"`([\w.]+)`", cells[-1])))
    return rows


def test_code_map_import_column_equals_the_real_imports():
    """Each row's import column names exactly the package modules its files import: a name is
    a module of the table's package (``agree``), else of the whole package (``runtime.tags``)."""
    modules = {_module(f) for f in PKG.rglob("*.py")}

    def resolve(package: str, name: str) -> str:
        if name == "lightning_matrixfsdp" or f"{package}.{name}" not in modules:
            return name if name == "lightning_matrixfsdp" else f"lightning_matrixfsdp.{name}"
        return f"{package}.{name}"

    def short(package: str, module: str) -> str:
        if module.startswith(package + "."):
            return module[len(package) + 1:]
        return module.split(".", 1)[1] if "." in module else module

    rows = _code_map_rows()
    assert len(rows) > 40, "the code map's tables were not found"
    wrong = []
    for package, files, names in rows:
        listed = {resolve(package, n) for n in names}
        unknown = sorted(n for n in names if resolve(package, n) not in modules)
        for name in files:
            path = ROOT / Path(*package.split(".")) / name
            if not path.is_file():
                wrong.append(f"{short('lightning_matrixfsdp', _module(path))}.py: no such file")
                continue
            real = _package_imports(path, modules)
            missing = sorted(short(package, m) for m in real - listed)
            extra = sorted(short(package, m) for m in listed - real - {resolve(package, n) for n in unknown})
            if missing or extra or unknown:
                wrong.append(f"{path.relative_to(PKG)}: missing {missing}, extra {extra}"
                             + (f", unknown {unknown}" if unknown else ""))
    assert not wrong, "docs/how-it-works.md's code map, import column:\n" + "\n".join(wrong)


def test_docs_results_stay_small():
    """Raw results only where a page cites them: the folder stays under 300 KB on disk, counted
    as a checkout stores it (``du``): every file rounded up to a 4 KiB block, and one block per
    folder, ``docs/results`` itself included. Many tiny files cost more than their bytes."""
    block = 4096
    root = ROOT / "docs" / "results"
    entries = [root, *root.rglob("*")]
    disk = {str(e.relative_to(ROOT)): (-(-e.stat().st_size // block) * block if e.is_file() else block)
            for e in entries}
    size = sum(disk.values())
    biggest = sorted(((b, p) for p, b in disk.items()), reverse=True)[:5]
    assert size < 300_000, (f"docs/results takes {size} bytes on disk ({len(entries)} files and folders, "
                            f"4 KiB blocks); the largest: {biggest}")


def test_checkpoints_read_the_runtime_only_through_its_view():
    """``checkpoint/`` imports from the runtime only its read-only view (``runtime.views.checkpoint``),
    the tensor-parallel layouts and DTensor views that do not communicate (``runtime.tp.layout``), and
    the communication modules (``is_comm_module``)."""
    modules = {_module(f) for f in PKG.rglob("*.py")}
    allowed = {"lightning_matrixfsdp.runtime.views.checkpoint", "lightning_matrixfsdp.runtime.tp.layout"}
    wrong = [f"checkpoint/{f.name}: {m}" for f in sorted((PKG / "checkpoint").glob("*.py"))
             for m in sorted(_package_imports(f, modules))
             if m.startswith("lightning_matrixfsdp.runtime") and m not in allowed
             and not is_comm_module(m)]
    assert not wrong, wrong
# ---------------------------------------------------------------- torch.distributed only in comm modules
def is_comm_module(module: str) -> bool:
    """A communication module: its file name says so (``comm``, ``collective``), or it lives in a
    ``comm`` package (``runtime/comm/``: the shared collectives)."""
    parts = module.split(".")
    return any(w in parts[-1] for w in ("comm", "collective")) or "comm" in parts[:-1]


#: Calls of torch.distributed that only ask (no communication): allowed anywhere.
DIST_QUERIES = {"is_available", "is_initialized", "get_rank", "get_world_size", "get_global_rank", "get_backend"}
#: Libraries under torch.distributed whose calls are not this package's communication: DCP
#: (``torch.distributed.checkpoint``) is the checkpoint format's reader and writer, whose
#: save/load coordinate the ranks inside torch; the package's own agreements around them
#: (``checkpoint/agree.py``) go through comm modules.
DIST_LIBRARIES = {"checkpoint"}
#: DTensor calls that build or describe without communicating: the placement records, and a
#: DTensor over a local tensor when its cross-rank check is off (``run_check=False``, required).
DIST_LOCAL = {"torch.distributed.tensor.Shard", "torch.distributed.tensor.Replicate",
              "torch.distributed.tensor.DTensor.from_local"}


def _dist_calls(path: Path) -> list[tuple[int, str]]:
    """(line, dotted callee) of every call in ``path`` that resolves to torch.distributed (any
    import form: ``import torch.distributed as dist``, ``from torch.distributed import x``,
    ``torch.distributed.x``, ``dist.x.y``, ``getattr(dist, "x")``), less the queries, libraries and
    local DTensor calls."""
    tree = ast.parse(path.read_text(), str(path))
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(e: ast.expr):
        if isinstance(e, ast.Name):
            return alias.get(e.id)
        if isinstance(e, ast.Attribute):
            base = dotted(e.value)
            return f"{base}.{e.attr}" if base else None
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and dotted(node.args[0])):
            name = f"{dotted(node.args[0])}.{node.args[1].value}"
        if not name or not name.startswith("torch.distributed."):
            continue
        parts = name.split(".")
        if parts[-1] in DIST_QUERIES and parts[2:-1] in ([], ["distributed_c10d"]):
            continue
        if parts[2] in DIST_LIBRARIES:
            continue
        if name in DIST_LOCAL and (not name.endswith("from_local") or any(
                k.arg == "run_check" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in node.keywords)):
            continue
        found.append((node.lineno, name))
    return sorted(found)


def test_torch_distributed_calls_only_in_comm_modules():
    """Every communication of the library is in a communication module (``is_comm_module``: the
    file name says so, or it is in ``runtime/comm/``); the rest calls those. ``bench/`` and ``demos/`` are not the library's
    runtime (the benchmark harness, the baseline systems it measures, example models) and
    are not checked."""
    bad = [f"{f.relative_to(PKG)}:{line}: {name}"
           for f in sorted(PKG.rglob("*.py")) if not {"bench", "demos"} & set(f.relative_to(PKG).parts)
           and not is_comm_module(_module(f))
           for line, name in _dist_calls(f)]
    assert not bad, "torch.distributed called outside a comm module:\n" + "\n".join(bad)


# ---------------------------------------------------------------- the rooms: Lightning side, runtime seam, root
#: Lightning's distributions (the unified package and the two standalone ones).
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
#: The layers below the adapters.
LOWER = ("runtime", "optim", "checkpoint", "qkclip")
#: The names that hand out the runtime's state object; only ``runtime/`` uses them.
STATE_NAMES = {"state_of", "find_state", "attach_state", "detach_state", "MatrixFSDPState"}


def _absolute_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in ``path`` at any depth, relative ones resolved."""
    me, is_pkg = _module(path), path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                base = me.split(".") if is_pkg else me.split(".")[:-1]
                src = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            out.append((src, [a.name for a in node.names]))
    return out


def test_lower_layers_import_neither_lightning_nor_the_adapters():
    """``runtime/``, ``optim/``, ``checkpoint/`` and ``qkclip/`` know no Lightning: everything that imports it is
    in ``adapters/`` (or the demos), and nothing below imports the adapters."""
    bad = []
    for layer in LOWER:
        for f in sorted((PKG / layer).rglob("*.py")):
            for src, names in _absolute_imports(f):
                full = [src] + [f"{src}.{n}" for n in names]
                if src.split(".")[0] in LIGHTNING or any(m.startswith("lightning_matrixfsdp.adapters") for m in full):
                    bad.append(f"{f.relative_to(PKG)}: import {src}" + (f" ({', '.join(names)})" if names else ""))
    assert not bad, "a lower layer imports Lightning or the adapters:\n" + "\n".join(bad)


def test_only_the_runtime_reaches_its_state_object():
    """Outside ``runtime/`` the runtime is used through its public functions (``runtime/queries.py``
    and the package's ``__init__``), never through the state object a sharded root carries."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if f.relative_to(PKG).parts[0] == "runtime":
            continue
        for src, names in _absolute_imports(f):
            if not src.startswith("lightning_matrixfsdp.runtime"):
                continue
            if src == "lightning_matrixfsdp.runtime.state" or "state" in names and src == "lightning_matrixfsdp.runtime":
                bad.append(f"{f.relative_to(PKG)}: imports the module runtime.state")
            bad += [f"{f.relative_to(PKG)}: from {src} import {n}" for n in names if n in STATE_NAMES]
    assert not bad, "outside runtime/, code reaches the runtime's state object:\n" + "\n".join(bad)


def test_package_root_holds_only_the_code_maps_root_files():
    """The package folder itself holds the public face and the entry points, the files of the code
    map's first table (its package is the top level); everything else lives in a sub-package."""
    listed = {name for package, files, _ in _code_map_rows() if package == "lightning_matrixfsdp" for name in files}
    present = {f.name for f in PKG.glob("*.py")}
    assert listed, "the code map has no table for the package root"
    assert present == listed, (f"package root: not in the code map's root table {sorted(present - listed)}; "
                               f"in the table but absent {sorted(listed - present)}")


# ---------------------------------------------------------------- errors: importable without the machinery
#: Files that still import ``MatrixShardError`` from ``runtime.options`` (its old home, which
#: re-exports it): owned by another session while this check landed. Once a file here is
#: changed the test below asks for its removal, so the list only shrinks.
OPTIONS_ERROR_IMPORTERS: set[str] = set()


def test_error_modules_import_nothing():
    """Every ``errors.py`` (``runtime/``, ``checkpoint/``) imports nothing but ``__future__``:
    raising or catching an error of the package never loads the planner, the option checks or
    torch.distributed."""
    bad = [f"{f.relative_to(PKG)}: {src or '.'}" for f in sorted(PKG.rglob("errors.py"))
           for src, _ in _absolute_imports(f) if src != "__future__"]
    assert not bad, "an errors module imports something:\n" + "\n".join(bad)


def test_matrix_shard_error_is_imported_from_errors():
    """``MatrixShardError`` lives in ``runtime/errors.py``; ``runtime/options.py`` only re-exports it
    for old imports. No module of the package or its tests imports it from there."""
    found = set()
    for f in sorted([*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        if "MatrixShardError" not in f.read_text():  # parse only the files that name it
            continue
        for src, names in _absolute_imports(f):
            if src == "lightning_matrixfsdp.runtime.options" and "MatrixShardError" in names:
                found.add(str(f.relative_to(ROOT)))
    assert found <= OPTIONS_ERROR_IMPORTERS, (
        f"import MatrixShardError from lightning_matrixfsdp.runtime.errors, not runtime.options: "
        f"{sorted(found - OPTIONS_ERROR_IMPORTERS)}")
    fixed = OPTIONS_ERROR_IMPORTERS - found
    assert not fixed, f"no longer imports it from runtime.options: drop from OPTIONS_ERROR_IMPORTERS: {sorted(fixed)}"


# ---------------------------------------------------------------- runtime/: one room per parallel style
#: The rooms of the runtime's parallel styles: none of them reads another.
STYLE_ROOMS = ("experts", "tp", "replicas")
#: Rooms every style may use; they use no style.
SHARED_ROOMS = ("comm", "mesh")
#: The room above the core: pipeline parallelism splits a model into stages and shards each with
#: ``matrix_shard``; no style or shared room reads it.
ABOVE_ROOMS = ("pipeline",)
#: The runtime's top level holds the core (units, placement, planner, roles, state, the assembly).
MAX_TOP_FILES = 26


def _room(module: str) -> str | None:
    prefix = "lightning_matrixfsdp.runtime."
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix):].split(".")
    return rest[0] if len(rest) > 1 else "core"


def test_runtime_rooms_keep_to_themselves():
    """A parallel style's folder never imports another style's folder; the shared rooms
    (``comm/``, ``mesh/``) import no style; the top level stays the core."""
    graph, _ = _graph()
    bad = []
    for a, targets in sorted(graph.items()):
        ra = _room(a)
        for b in sorted(targets):
            rb = _room(b)
            if ra in STYLE_ROOMS and rb in STYLE_ROOMS and ra != rb:
                bad.append(f"{a} -> {b}: one style reads another")
            if ra in SHARED_ROOMS and rb in STYLE_ROOMS:
                bad.append(f"{a} -> {b}: a shared room reads a style")
            if rb in ABOVE_ROOMS and ra in STYLE_ROOMS + SHARED_ROOMS:
                bad.append(f"{a} -> {b}: a style or shared room reads the pipeline above it")
    assert not bad, "\n".join(bad)
    top = sorted(f.name for f in (PKG / "runtime").glob("*.py"))
    assert len(top) <= MAX_TOP_FILES, f"runtime/ has {len(top)} top-level files: {top}"
