"""``python -m lightning_matrixfsdp.bench.convergence ...``: the convergence benchmark's command line."""

from .grid import main

if __name__ == "__main__":
    main()
