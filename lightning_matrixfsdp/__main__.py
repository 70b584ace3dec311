"""``python -m lightning_matrixfsdp fit --config ...``: LightningCLI with the strategy registered."""

from lightning_matrixfsdp.cli import main

if __name__ == "__main__":
    main()
