"""The public ways into the package keep working after files move: the names of
``lightning_matrixfsdp``, the registered strategy name, the console script, and every
documented ``python -m`` command (run once each with ``--help``, in one subprocess)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent

#: The documented ``python -m`` commands (README, docs/, scripts/) and the words their usage line shows.
COMMANDS = {
    ("lightning_matrixfsdp",): "lightning-matrixfsdp",
    ("lightning_matrixfsdp.consolidate",): "python -m lightning_matrixfsdp.consolidate",
    ("lightning_matrixfsdp.bench",): "python -m lightning_matrixfsdp.bench",
    ("lightning_matrixfsdp.bench", "predict"): "python -m lightning_matrixfsdp.bench predict",
    ("lightning_matrixfsdp.bench.convergence",): "python -m lightning_matrixfsdp.bench.convergence",
}


def test_every_public_name_imports_from_the_package_root():
    import lightning_matrixfsdp as mf

    missing = [n for n in mf.__all__ if not hasattr(mf, n)]
    assert not missing, missing
    from lightning_matrixfsdp.adapters import MatrixFSDPFabricStrategy, MatrixFSDPStrategy, PretrainedWeights

    assert (mf.MatrixFSDPStrategy, mf.MatrixFSDPFabricStrategy, mf.PretrainedWeights) == (
        MatrixFSDPStrategy, MatrixFSDPFabricStrategy, PretrainedWeights)


def test_registered_names_are_unchanged():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_matrixfsdp as mf

    assert StrategyRegistry.get("matrix_fsdp") is not None
    assert type(StrategyRegistry.get("matrix_fsdp")) is mf.MatrixFSDPStrategy
    assert type(STRATEGY_REGISTRY.get("matrix_fsdp")) is mf.MatrixFSDPFabricStrategy


def test_console_script_target_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["lightning-matrixfsdp"].partition(":")
    assert callable(getattr(import_module(module), name))


def test_documented_python_m_commands_start():
    """Each command through ``runpy`` as ``python -m`` runs it, ``--help`` exiting 0 with its usage line."""
    code = "\n".join([
        "import runpy, sys",
        f"for argv in {sorted(COMMANDS)!r}:",
        "    sys.argv = [argv[0], *argv[1:], '--help']",
        "    try:",
        "        runpy.run_module(argv[0], run_name='__main__', alter_sys=True)",
        "    except SystemExit as e:",
        "        assert e.code in (0, None), (argv, e.code)",
        "    else:",
        "        raise AssertionError(f'{argv}: --help did not exit')",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    usage = " ".join(out.stdout.split())
    for argv, prog in COMMANDS.items():
        assert f"usage: {prog} " in usage, (argv, out.stdout[-2000:])
