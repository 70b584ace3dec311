"""The convergence benchmark of the orthogonalizers (``python -m lightning_matrixfsdp.bench.convergence``).

``grid.py`` the command line and the grid of runs, ``run.py`` one run, ``variants.py`` the
orthogonalizers trained, ``corpus.py`` the offline text, ``timing.py`` the timing pass,
``report.py`` the report. The names of ``grid.py`` are importable from here, as they were
from the single module this package replaces.
"""

from .grid import *  # noqa: F401,F403
