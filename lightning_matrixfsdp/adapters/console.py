"""The optimizer's one-line routing account, on rank zero's console, under any strategy.

``optim/groups.py`` logs, when an optimizer of this package is built, how many tensors each
update gets and why (logger ``lightning_matrixfsdp.roles``, level INFO). Python shows no INFO
record without a handler, so importing the package gives that one logger a console handler
that lets through rank zero's records only, as Lightning does for its own messages. A user
who configured the logger (a handler of their own) keeps it as it is.
"""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only

__all__ = ["show_routing_lines"]

ROLES_LOGGER = "lightning_matrixfsdp.roles"


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return getattr(rank_zero_only, "rank", 0) == 0


def show_routing_lines() -> None:
    """Give the routing logger a rank-zero console handler (idempotent; kept if configured)."""
    logger = logging.getLogger(ROLES_LOGGER)
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_RankZero())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # one line, not a second copy through a root handler
