"""The documentation says what the code does.

- README.md starts with exactly the two set-up commands, and .ci/run runs the second.
- Every option table marked ``<!-- signature: module.Name -->`` in docs/user-guide.md
  lists exactly the parameters of that callable, with the defaults the code has; the
  strategy options table says what each does in ``MatrixFSDPConfig``'s words (``doc=``).
- Every file that a command in README.md or docs/*.md runs or reads exists, every
  ``python -m`` module is importable, and every relative link resolves.
- The Python snippets compile; the README's YAML config parses into the documented
  strategy; the README's custom training loop runs as written (2 processes).
- The multi-node example (two torchrun "nodes" x 2 gloo processes, 2x2 HSDP) runs on CPU
  within 90 s and confirms that replicas exchange only owned gradients.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "user-guide.md"
SETUP_COMMANDS = [
    "pip install torch==2.13.0 -c constraints.txt -e . && lightning-matrixfsdp fit --config examples/pretrain_gpt.yaml",
    'pip install torch==2.13.0 -c constraints.txt -e ".[test,litgpt]" && python -m pytest -q -p no:cacheprovider',
]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str, langs: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def _env_with_this_python() -> dict[str, str]:
    """Console scripts and ``python`` resolve to this interpreter's environment."""
    from conftest import clean_env

    env = clean_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# ---------------------------------------------------------------------- README and CI
def test_readme_starts_with_the_two_setup_commands() -> None:
    text = README.read_text()
    first = FENCE.search(text)
    assert first is not None, "README.md has no code block"
    before = [ln for ln in text[: first.start()].splitlines() if ln.strip()]
    assert len(before) <= 1 and all(ln.startswith("# ") for ln in before), (
        f"only a title may precede the set-up commands, found {before}")
    lines = [ln for ln in first.group(2).splitlines() if ln.strip()]
    assert lines == SETUP_COMMANDS, lines


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert SETUP_COMMANDS[1] in [ln.strip() for ln in ci]


def _requirements() -> list[str]:
    """The package's dependencies and the extras the README installs, as requirement strings."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *extras["test"], *extras["litgpt"], "torch==2.13.0"]


def test_constraints_pin_every_requirement_within_its_range() -> None:
    """constraints.txt must pin (==) each declared requirement at a version its range admits.

    Fails when a floor in pyproject.toml moves past the pin, or a new dependency is added
    without regenerating the pins (scripts/update_constraints.sh).
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = Version(version)
    for text in _requirements():
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt does not pin {req.name} (required as {text!r})"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside the required {text!r}")
    assert "lightning-matrixfsdp" not in pins, "constraints.txt must not pin the package itself"


# ---------------------------------------------------------------------- option tables vs. signatures
def _signature_tables(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{"module.Name": [(name, default cell), ...]}`` for every marked table."""
    tables: dict[str, list[tuple[str, str]]] = {}
    for m in re.finditer(r"<!-- signature: ([\w.]+) -->\n((?:\|.*\n)+)", text):
        rows = []
        for line in m.group(2).splitlines()[2:]:  # skip header and separator
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = re.fullmatch(r"`(\w+)`", cells[0])
            assert name, f"{m.group(1)}: first cell must be a `name`: {line}"
            rows.append((name.group(1), cells[1]))
        tables[m.group(1)] = rows
    return tables


def _parse_default(cell: str) -> object:
    if cell == "required":
        return inspect.Parameter.empty
    code = re.fullmatch(r"`([^`]+)`", cell)
    assert code, f"default cell must be `code` or 'required': {cell!r}"
    return eval(code.group(1), {"__builtins__": {}, "timedelta": timedelta})  # noqa: S307


def _parameters(dotted: str) -> dict[str, inspect.Parameter]:
    module, _, name = dotted.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    return {k: p for k, p in sig.parameters.items() if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def test_documented_options_exist_with_their_defaults() -> None:
    tables = _signature_tables(GUIDE.read_text())
    for required in ("lightning_matrixfsdp.MatrixFSDPStrategy", "lightning_matrixfsdp.matrix_shard",
                     "lightning_matrixfsdp.Muon", "lightning_matrixfsdp.Shampoo", "lightning_matrixfsdp.SOAP"):
        assert required in tables, f"docs/user-guide.md has no signature table for {required}"
    for dotted, rows in tables.items():
        params = _parameters(dotted)
        documented = [name for name, _ in rows]
        assert len(set(documented)) == len(documented), f"{dotted}: an option is listed twice"
        assert set(documented) == set(params), (
            f"{dotted}: documented but not in the signature: {sorted(set(documented) - set(params))}; "
            f"in the signature but not documented: {sorted(set(params) - set(documented))}")
        for name, cell in rows:
            want, have = _parse_default(cell), params[name].default
            assert want == have and type(want) is type(have), (
                f"{dotted}({name}=...): documented default {cell} but the code has {have!r}")


def _described(dotted: str) -> dict[str, str]:
    """``{option: its "what it does" cell}`` of the marked table of ``dotted``."""
    table = re.search(rf"<!-- signature: {re.escape(dotted)} -->\n((?:\|.*\n)+)", GUIDE.read_text())
    assert table, f"docs/user-guide.md has no signature table for {dotted}"
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.group(1).splitlines()[2:]]
    return {row[0].strip("`"): row[2] for row in rows}


def test_option_tables_say_what_the_config_says() -> None:
    """The strategy options table says what each option does in the words of ``MatrixFSDPConfig``
    (each field's ``doc``, which the strategies' docstrings and ``--help`` show too); the
    ``matrix_shard`` table, for its one option the strategies do not take (``ns_steps``)."""
    from dataclasses import fields

    from lightning_matrixfsdp.runtime.config import ADAPTER, CONFIG_DOC, SHARD, MatrixFSDPConfig

    docs = {f.name: f.metadata["doc"] for f in fields(MatrixFSDPConfig)}
    table = _described("lightning_matrixfsdp.MatrixFSDPStrategy")
    want = {**{n: docs[n] for n in MatrixFSDPConfig.names(ADAPTER)}, "config": CONFIG_DOC}
    wrong = [f"{n}:\n  table:  {table.get(n)}\n  config: {d}" for n, d in want.items() if table.get(n) != d]
    shard_only = set(MatrixFSDPConfig.names(SHARD)) - set(MatrixFSDPConfig.names(ADAPTER))
    shard_table = _described("lightning_matrixfsdp.matrix_shard")
    wrong += [f"{n} (matrix_shard):\n  table:  {shard_table.get(n)}\n  config: {docs[n]}" for n in sorted(shard_only)
              if shard_table.get(n) != docs[n]]
    assert not wrong, ("docs/user-guide.md's option tables and MatrixFSDPConfig's doc= differ (change both):\n"
                       + "\n".join(wrong))


# ---------------------------------------------------------------------- commands, paths and links
_RUNNERS = ("python", "python3", "lightning-matrixfsdp", "torchrun", "bash", "sbatch", "srun", "tensorboard")
_FILE_SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".sbatch")


def _commands(text: str) -> list[str]:
    """Shell commands in bash/sh code blocks (continuations joined) and in inline code spans."""
    cmds = []
    for body in _blocks(text, ("bash", "sh", "shell", "console", "")):
        joined = re.sub(r"\\\n\s*", " ", body)
        cmds += [ln.strip() for ln in joined.splitlines()]
    prose = FENCE.sub("", text)
    cmds += [c.strip() for c in re.findall(r"`([^`\n]+)`", prose)]
    return [c for c in cmds if c.split(" ", 1)[0] in _RUNNERS]


def _provided_files(text: str) -> set[str]:
    """Files a document gives the reader itself: "Save this as `x`" or a block headed ``# x.py``."""
    names = set(re.findall(r"[Ss]ave (?:this|it) as `([^`]+)`", text))
    for _, body in FENCE.findall(text):
        head = re.match(r"#\s*([\w./-]+\.(?:py|ya?ml|sh))\b", body)
        if head:
            names.add(head.group(1))
    return names


def test_files_and_modules_in_commands_exist() -> None:
    checked = 0
    for doc in _docs():
        text = doc.read_text()
        provided = _provided_files(text)
        for cmd in _commands(text):
            try:
                tokens = shlex.split(cmd, comments=True)
            except ValueError:  # e.g. an unbalanced quote in prose; nothing to check
                continue
            for i, tok in enumerate(tokens):
                if tok == "-m" and i + 1 < len(tokens) and tokens[0].startswith(("python", "torchrun")):
                    mod = tokens[i + 1]
                    assert importlib.util.find_spec(mod) is not None, f"{doc.name}: `{cmd}`: no module {mod}"
                    checked += 1
                path = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
                if (not path.endswith(_FILE_SUFFIXES) or path.startswith("-")
                        or any(ch in path for ch in "$<>*~{}")):
                    continue
                if path in provided:
                    continue
                assert (ROOT / path).exists(), f"{doc.relative_to(ROOT)}: `{cmd}` refers to missing {path}"
                checked += 1
    assert checked >= 10, f"only {checked} paths/modules found: is the parser broken?"


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", md.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve() -> None:
    for doc in _docs():
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.relative_to(ROOT)} links to missing anchor {target}"


#: A path under docs/results as the pages cite it (``docs/results/x``, a relative ``results/x``, or a
#: bare run name in backticks in the results index); ``git show REV:path`` names history, not the tree.
_RESULT_PATH = re.compile(r"(git show [0-9a-f]+:)?(?:(?:docs/)?results/|(?<=`))(20\d\d-\d\d-\d\d-[\w.*<>-]+(?:/[\w.-]*)?)")


def test_cited_results_exist() -> None:
    """Every file or folder under docs/results that a page, the changelog, a script or the package
    names exists (the folder's files get moved and merged to keep it small)."""
    sources = [*_docs(), ROOT / "CHANGELOG.md", ROOT / "docs" / "results" / "README.md",
               *sorted((ROOT / "scripts").glob("*.*")), *sorted((ROOT / "lightning_matrixfsdp").rglob("*.py"))]
    cited = [(src, m.group(2).rstrip(".,;:")) for src in sources for m in _RESULT_PATH.finditer(src.read_text())
             if not m.group(1)]
    missing = [f"{src.relative_to(ROOT)}: {path}" for src, path in cited
               if not any(ch in path for ch in "*<>") and not (ROOT / "docs" / "results" / path).exists()]
    assert len(cited) >= 30, f"only {len(cited)} citations found: is the pattern broken?"
    assert not missing, "cited but not in docs/results:\n" + "\n".join(missing)


def test_python_snippets_compile_and_the_public_api_imports() -> None:
    blocks = [(doc, body) for doc in _docs() for body in _blocks(doc.read_text(), ("python",))]
    assert len(blocks) >= 5
    for doc, body in blocks:
        compile(body, f"{doc.name} snippet", "exec")
    api = next(body for doc, body in blocks if doc == GUIDE and body.startswith("from lightning_matrixfsdp import ("))
    exec(compile(api, "user-guide public API", "exec"), {})  # noqa: S102 - every name listed exists


def test_readme_yaml_config_builds_the_documented_strategy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.cli import cli_main
    from lightning_matrixfsdp.demos.gpt import Block

    yaml = next(b for b in _blocks(README.read_text(), ("yaml",)) if "MatrixFSDPStrategy" in b)
    (tmp_path / "my_strategy.yaml").write_text(yaml)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])  # pytest's own arguments are not the CLI's
    cli = cli_main(["--config", str(ROOT / "examples" / "pretrain_gpt.yaml"), "--config", "my_strategy.yaml"],
                   run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, mf.MatrixFSDPStrategy)
    assert strategy.planner == "cost_aware" and strategy.wrap_policy == {Block}
    assert strategy.activation_checkpointing_policy == {Block}
    opt = strategy.optimizer_factory([torch.nn.Parameter(torch.zeros(2, 2))])
    assert isinstance(opt, mf.Muon) and opt.defaults["lr"] == 0.01 and opt.defaults["adamw_lr"] == 0.003


def test_readme_custom_loop_runs_as_written(tmp_path: Path) -> None:
    code = next(b for b in _blocks(README.read_text(), ("python",)) if "matrix_shard(" in b and "torchrun" in b)
    (tmp_path / "train_loop.py").write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train_loop.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env_with_this_python(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "MatrixFSDP plan: planner=role_greedy span=2" in proc.stdout
    assert "step 9 loss" in proc.stdout
    assert "'optimizer_step': {'sent': 0, 'recv': 0, 'calls': 0}" in proc.stdout


# ---------------------------------------------------------------------- the multi-node example
def test_multi_node_example_runs_on_cpu(tmp_path: Path) -> None:
    env = _env_with_this_python()
    env.update(TORCHRUN=f"{sys.executable} -m torch.distributed.run", ACCELERATOR="cpu", MAX_STEPS="3")
    env.pop("MASTER_PORT", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "examples" / "multi_node.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert elapsed < 90, f"the multi-node example took {elapsed:.0f} s"
    rows = [ln for ln in proc.stdout.splitlines() if re.match(r"\[multi-node\]\s+\d+\s+\d+\s", ln)]
    assert len(rows) == 4, proc.stdout[-3000:]
    # ranks 0,1 on node 0 and 2,3 on node 1; shard groups are the nodes; replicas pair across nodes
    for ln, (rank, node, shard, replicas) in zip(rows, [(0, 0, "[0, 1]", "[0, 2]"), (1, 0, "[0, 1]", "[1, 3]"),
                                                        (2, 1, "[2, 3]", "[0, 2]"), (3, 1, "[2, 3]", "[1, 3]")]):
        fields = ln.split(None, 3)
        assert (int(fields[1]), int(fields[2])) == (rank, node), ln
        assert shard in ln and replicas in ln, ln
    assert "span W=2, replicas R=2, world=4, nodes=2" in proc.stdout
    assert "optimizer step moved 0 bytes: OK" in proc.stdout
    assert list((tmp_path / "runs" / "multi_node").rglob("events.out.tfevents.*")), "no TensorBoard logs"
