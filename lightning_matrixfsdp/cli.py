"""LightningCLI entry point with the ``matrix_fsdp`` strategy registered.

Lightning has no plugin discovery for strategies: a YAML saying
``trainer.strategy: matrix_fsdp`` only resolves if ``lightning_matrixfsdp`` was
imported before the Trainer is built. This module is that import, for the console
script ``lightning-matrixfsdp`` and for ``python -m lightning_matrixfsdp``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning_matrixfsdp  # noqa: F401  (import side effect: registers "matrix_fsdp")
from lightning.pytorch.cli import ArgsType, LightningCLI


class MatrixFSDPCLI(LightningCLI):
    """LightningCLI with the defaults our examples rely on.

    ``auto_configure_optimizers=True`` keeps ``--optimizer``/``--lr_scheduler``
    available for any module, which is how an existing module is switched to
    ``lightning_matrixfsdp.Muon`` without editing it. The saved ``config.yaml`` is
    overwritten so re-running an example into the same log directory works.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_configure_optimizers", True)
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("prog", "lightning-matrixfsdp")  # not "__main__.py" under python -m
        kwargs["parser_kwargs"] = parser_kwargs
        save_config_kwargs = dict(kwargs.pop("save_config_kwargs", None) or {})
        save_config_kwargs.setdefault("overwrite", True)
        kwargs["save_config_kwargs"] = save_config_kwargs
        super().__init__(*args, **kwargs)


def cli_main(args: ArgsType = None, run: bool = True, **kwargs: Any) -> MatrixFSDPCLI:
    """Build (and by default run) the CLI; returns it for programmatic use and tests."""
    return MatrixFSDPCLI(args=args, run=run, **kwargs)


def main(args: Optional[Union[list[str], dict[str, Any]]] = None) -> None:
    """Console-script entry: returns None so ``sys.exit(main())`` exits with status 0."""
    cli_main(args)


if __name__ == "__main__":
    main()
